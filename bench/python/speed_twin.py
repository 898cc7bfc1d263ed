"""The example against its PyTorch-Python twin, for speed, side by side in one run.

frugal's side is `fashion_mnist` as a user runs it (default environment, its default
optimizer, frugal's allocator); PyTorch's side is the same CNN, data, batch, optimizer
settings and variant trained in this Python process with PyTorch's own tools and
allocator (nothing of frugal is loaded here). The two alternate, variant by variant, for
several rounds; each figure is the median step time over all rounds (a step: forward,
backward, optimizer step, zeroing; the first steps of each run are warm-up).

    python bench/python/speed_twin.py --binary build/torch2/examples/fashion_mnist \
        [--steps 300] [--rounds 2] [--threads 2]
"""
import argparse
import gzip
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

WARMUP = 10
DATA = "/usr/share/datasets/fashion-mnist"


def load_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


def cnn(dropout):
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Dropout(dropout)),
        nn.Linear(1024, 10))


def python_run(variant, images, labels, steps, batch=64, lr=1e-3, dropout=0.4, seed=1):
    torch.manual_seed(seed)
    net = cnn(dropout)
    adam = torch.optim.Adam(net.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(images.shape[0], generator=generator)
    micro = 16 if variant == "micro-batch 16" else batch
    times = []
    for i in range(steps):
        idx = order[i * batch:(i + 1) * batch]
        x, y = images.index_select(0, idx), labels.index_select(0, idx)
        start = time.perf_counter()
        total = 0.0
        for part in range(0, batch, micro):
            xs, ys = x[part:part + micro], y[part:part + micro]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16"):
                if variant == "checkpoint":
                    h = xs
                    for block in list(net)[:-1]:
                        h = checkpoint(block, h, use_reentrant=False)
                    out = net[-1](h)
                else:
                    out = net(xs)
            loss = F.cross_entropy(out.float(), ys) * (xs.shape[0] / batch)
            loss.backward()
            total += loss.item()
        adam.step()
        adam.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - start) * 1e3)
    return times[WARMUP:]


FLAGS = {"plain": [], "bf16": ["--autocast", "bf16"], "checkpoint": ["--checkpoint"],
         "micro-batch 16": ["--micro-batch", "16"]}


def frugal_run(binary, variant, steps, threads, extra):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        subprocess.run([binary, "--model", "cnn", "--max-steps", str(steps), "--threads",
                        str(threads), "--quiet", "--report", report, *FLAGS[variant], *extra],
                       check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in open(report)]
    return [r["time_ms"] for r in rows if r.get("event") != "eval"][WARMUP:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/torch2/examples/fashion_mnist")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images = load_idx(f"{DATA}/train-images-idx3-ubyte.gz").unsqueeze(1).float().div_(255)
    labels = load_idx(f"{DATA}/train-labels-idx1-ubyte.gz").long()

    rows = [(v, []) for v in FLAGS] + [("plain, LibTorch's Adam", [])]
    times = {name: {"frugal": [], "pytorch": []} for name, _ in rows}
    for _ in range(args.rounds):
        for name, _ in rows:
            variant = name.split(",")[0]
            extra = ["--torch-optimizer"] if "LibTorch's Adam" in name else []
            times[name]["frugal"] += frugal_run(args.binary, variant, args.steps, args.threads, extra)
            times[name]["pytorch"] += python_run(variant, images, labels, args.steps)

    print(f"fashion_mnist against PyTorch in Python, same LibTorch ({torch.__version__}), "
          f"{args.threads} threads, CNN batch 64, Adam 1e-3, {args.rounds} rounds of "
          f"{args.steps} steps, medians of steps after {WARMUP} warm-up steps\n")
    print("| variant | frugal (ms/step) | PyTorch (ms/step) | ratio |")
    print("|---|---|---|---|")
    for name, _ in rows:
        f = statistics.median(times[name]["frugal"])
        p = statistics.median(times[name]["pytorch"])
        print(f"| {name} | {f:.1f} | {p:.1f} | {f / p:.2f} |")


if __name__ == "__main__":
    main()
