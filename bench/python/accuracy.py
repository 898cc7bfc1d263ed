#!/usr/bin/env python3
"""Test accuracy by epoch of the Fashion-MNIST CNN trained with frugal's smaller formats
(bfloat16 weights with stochastic rounding, 8-bit and 4-bit states, factored second moments,
no first moment)
against float32 Adam, seed by seed: the table of docs/benchmarks-history.md's accuracy rows.

Usage: accuracy.py FASHION_MNIST_BINARY [--epochs 3] [--seeds 1 2] [--threads 2]
                   [--configs adam factored ...] [--extra "--max-steps 3 --eval-samples 100"]
Each run is the example's own command line (`--model cnn`, batch 64, Adam's 1e-3) with the
configuration's flags; the accuracies are read from its per-epoch lines.
"""
import argparse
import json
import re
import shlex
import subprocess
import sys

CONFIGS = {
    "adam": ("float32 Adam (the reference)", []),
    "bf16-sr": ("bf16 weights, stochastic rounding", ["--weights", "bf16"]),
    "8bit": ("Adam8bit (8-bit states)", ["--optimizer", "adam8bit"]),
    "factored": ("Adam8bit, factored second moment", ["--optimizer", "adam8bit", "--factored"]),
    "factored-b0": ("Adam8bit, factored, no first moment",
                    ["--optimizer", "adam8bit", "--factored", "--beta1", "0"]),
    "4bit": ("Adam4bit (4-bit states)", ["--optimizer", "adam4bit"]),
    "4bit-factored": ("Adam4bit, factored second moment",
                      ["--optimizer", "adam4bit", "--factored"]),
}
EPOCH = re.compile(r"^epoch (\d+): .* accuracy ([0-9.]+)$", re.M)


def run(binary, flags, seed, epochs, threads, extra):
    cmd = [binary, "--model", "cnn", "--epochs", str(epochs), "--seed", str(seed),
           "--threads", str(threads), *flags, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    return [float(a) for _, a in EPOCH.findall(done.stdout)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--extra", default="", help="flags added to every run")
    args = parser.parse_args()
    extra = shlex.split(args.extra)
    configs = ["adam"] + [c for c in args.configs if c != "adam"]
    acc = {(c, s): run(args.binary, CONFIGS[c][1], s, args.epochs, args.threads, extra)
           for c in configs for s in args.seeds}
    epochs = max(len(a) for a in acc.values())
    print(f"accuracy.py: Fashion-MNIST CNN, {args.epochs} epochs, seeds {args.seeds}, "
          f"{args.threads} threads\n")
    print("| configuration | seed | " + " | ".join(f"epoch {e + 1}" for e in range(epochs))
          + " | most below Adam, any epoch (points) |")
    print("|---|---|" + "---|" * epochs + "---|")
    rows = []
    for c in configs:
        for s in args.seeds:
            a, ref = acc[(c, s)], acc[("adam", s)]
            gap = max((r - x for x, r in zip(a, ref)), default=0.0) * 100
            print(f"| {CONFIGS[c][0]} | {s} | " + " | ".join(f"{x:.4f}" for x in a)
                  + f" | {gap:.2f} |")
            rows.append({"config": c, "seed": s, "accuracy": a, "gap_points": gap})
    print("\n" + json.dumps({"bench": "accuracy", "epochs": args.epochs, "rows": rows}))


if __name__ == "__main__":
    main()
