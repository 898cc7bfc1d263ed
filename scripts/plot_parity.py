#!/usr/bin/env python3
"""Compares fashion_mnist runs of two optimizers (JSON-lines reports, one per seed): a PNG
of the training loss (running mean over 100 steps) and test accuracy by epoch, and a
markdown table of the test accuracies.

    python3 scripts/plot_parity.py --a adam-s1.jsonl adam-s2.jsonl \\
        --b adam8bit-s1.jsonl adam8bit-s2.jsonl --names "Adam" "8-bit Adam" -o parity.png
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    losses, accuracy = [], {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"plot_parity: {path}:{number}: not JSON ({e})")
            if row.get("event") == "eval":
                accuracy[row["epoch"]] = row["accuracy"]
            elif "event" not in row:
                losses.append(row["loss"])
    if not losses or not accuracy:
        sys.exit(f"plot_parity: {path} holds no steps or no evaluations")
    return losses, accuracy


def running_mean(values, window=100):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="+", required=True, help="reports of the first optimizer")
    parser.add_argument("--b", nargs="+", required=True, help="reports of the second, same seeds")
    parser.add_argument("--names", nargs=2, default=["a", "b"], help="the two optimizers' names")
    parser.add_argument("-o", "--output", default="parity.png", help="PNG to write")
    args = parser.parse_args()
    if len(args.a) != len(args.b):
        sys.exit("plot_parity: --a and --b need one report per seed each, in the same order")

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = []
    for seed, (path_a, path_b) in enumerate(zip(args.a, args.b), 1):
        (loss_a, acc_a), (loss_b, acc_b) = load(path_a), load(path_b)
        for name, losses, acc, style in ((args.names[0], loss_a, acc_a, "-"),
                                         (args.names[1], loss_b, acc_b, "--")):
            loss_ax.plot(running_mean(losses), style, linewidth=1, label=f"{name}, run {seed}")
            epochs = sorted(acc)
            acc_ax.plot(epochs, [acc[e] for e in epochs], style + "o", label=f"{name}, run {seed}")
        for epoch in sorted(acc_a):
            if epoch in acc_b:
                rows.append((seed, epoch, acc_a[epoch], acc_b[epoch]))
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("training loss (mean of the last 100 steps)")
    loss_ax.set_ylim(bottom=0)
    loss_ax.legend()
    acc_ax.set_xticks(sorted({epoch for _, epoch, _, _ in rows}))
    acc_ax.set_xlabel("epoch")
    acc_ax.set_ylabel("test accuracy")
    acc_ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)

    print(f"| run | epoch | {args.names[0]} | {args.names[1]} | difference (points) |")
    print("|---|---|---|---|---|")
    for seed, epoch, a, b in rows:
        print(f"| {seed} | {epoch} | {a:.4f} | {b:.4f} | {100 * (b - a):+.2f} |")
    worst = max(abs(b - a) for _, _, a, b in rows)
    print(f"\nlargest difference: {100 * worst:.2f} points")


if __name__ == "__main__":
    main()
