#!/usr/bin/env python3
"""Turns a JSON-lines report of frugal (fashion_mnist --report FILE) into a PNG with two
charts: memory over steps (allocated, step peak, and the ledger's parts) and loss (train
per step, test per evaluation).

    python3 scripts/plot_report.py run.jsonl -o run.png
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2 ** 20


def load(path):
    steps, evals = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_report: {path}:{number}: not JSON ({e})")
            (evals if row.get("event") == "eval" else steps).append(row)
    if not steps:
        sys.exit(f"plot_report: {path} holds no step reports")
    return steps, evals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="JSON-lines report")
    parser.add_argument("-o", "--output", default="report.png", help="PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    steps, evals = load(args.report)
    x = [r["step"] for r in steps]

    fig, (mem, loss) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    for key, label in [("peak_bytes", "step peak"), ("allocated_bytes", "allocated after step"),
                       ("weights_bytes", "weights"), ("grads_bytes", "gradients"),
                       ("optimizer_bytes", "optimizer state"), ("other_bytes", "other")]:
        mem.plot(x, [r[key] / MIB for r in steps], label=label, linewidth=1)
    mem.set_ylabel("MiB")
    mem.set_title(args.title or f"memory per step ({args.report})")
    mem.legend(loc="upper right", fontsize="small")
    mem.grid(alpha=0.3)

    loss.plot(x, [r["loss"] for r in steps], label="train loss (batch)", linewidth=0.5, alpha=0.6)
    if evals:
        loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="test loss")
        acc = loss.twinx()
        acc.plot([r["step"] for r in evals], [r.get("accuracy", float("nan")) for r in evals],
                 "s--", color="tab:green", label="test accuracy")
        acc.set_ylabel("accuracy")
        acc.legend(loc="center right", fontsize="small")
    loss.set_xlabel("optimizer step")
    loss.set_ylabel("loss")
    loss.legend(loc="upper right", fontsize="small")
    loss.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=90)
    print(f"plot_report: wrote {args.output} ({len(steps)} steps, {len(evals)} evaluations)")


if __name__ == "__main__":
    main()
