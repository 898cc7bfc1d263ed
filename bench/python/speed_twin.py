"""The example against its PyTorch-Python twin, for speed, side by side in one run.

frugal's side is `fashion_mnist` as a user runs it (default environment, its default
optimizer, frugal's allocator); PyTorch's side is the same CNN, data, batch, optimizer
settings and variant trained in this Python process with PyTorch's own tools and
allocator (frugal's allocator is loaded only for `--allocator`'s run, after all others).
The two alternate, variant by variant, for several rounds; each figure is the median step
time over all rounds (a step: forward, backward, optimizer step, zeroing; the first steps of
each run are warm-up).

PyTorch's side is written twice, and the faster one is the reference: as nested
`nn.Sequential` modules (the form of the C++ example) and as one small `nn.Module` whose
forward calls the functional ops. frugal's step is also split into its kernels and its own
cost: `bench_engine --model cnn` runs the same CNN under the Trainer beside a hand-written
LibTorch C++ loop in the same run (the hand-written loop is the kernels and LibTorch's
dispatch; the difference is frugal's own). `--profile` prints each Python form's busiest
operators (torch.profiler), which says where the two forms differ; `--allocator` runs the
fastest form again with frugal's caching CPU allocator installed in this process (and PyTorch's
own put back after), which says how much of the gap is the allocator's.

    python bench/python/speed_twin.py --binary build/torch2/examples/fashion_mnist \
        [--engine build/torch2/bench/bench_engine] [--steps 300] [--rounds 2] [--threads 2]
        [--micro-batch 16] [--warmup 10] [--variants plain bf16 ...] [--profile] [--allocator]
"""
import argparse
import ctypes
import functools
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from reports import WARMUP, add_warmup, check_warmup, step_records

DATA = "/usr/share/datasets/fashion-mnist"


def load_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return torch.frombuffer(bytearray(raw[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape)


@functools.lru_cache(maxsize=1)
def load_fashion():
    """Fashion-MNIST's training images (N, 1, 28, 28) in [0, 1] and labels, read once a process."""
    images = load_idx(f"{DATA}/train-images-idx3-ubyte.gz").unsqueeze(1).float().div_(255)
    return images, load_idx(f"{DATA}/train-labels-idx1-ubyte.gz").long()


def cnn(dropout):
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Dropout(dropout)),
        nn.Linear(1024, 10))


class FunctionalCNN(nn.Module):
    """The same CNN, parameters and initialisation as `cnn`, its forward in functional ops."""

    def __init__(self, dropout):
        super().__init__()
        net = cnn(dropout)  # same shapes and default initialisation, same RNG draws
        self.conv1, self.conv2 = net[0][0], net[1][0]
        self.fc1, self.fc2 = net[2][1], net[3]
        self.dropout = dropout

    def block(self, i, x):
        if i < 2:
            conv = self.conv1 if i == 0 else self.conv2
            return F.max_pool2d(F.relu(F.conv2d(x, conv.weight, conv.bias, padding=2)), 2)
        h = F.relu(F.linear(x.flatten(1), self.fc1.weight, self.fc1.bias))
        return F.dropout(h, self.dropout, self.training)

    def blocks(self):
        return [lambda x, i=i: self.block(i, x) for i in range(3)]

    def head(self, x):
        return F.linear(x, self.fc2.weight, self.fc2.bias)

    def forward(self, x):
        for i in range(3):
            x = self.block(i, x)
        return self.head(x)


FORMS = ("modules", "functional")


def make_net(form, dropout):
    return cnn(dropout) if form == "modules" else FunctionalCNN(dropout)


def forward(net, form, x, checkpointed):
    if not checkpointed:
        return net(x)
    blocks, head = (list(net)[:-1], net[-1]) if form == "modules" else (net.blocks(), net.head)
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False)
    return head(x)


def python_run(form, variant, images, labels, steps, batch, micro=16, warmup=WARMUP,
               lr=1e-3, dropout=0.4, seed=1, profile=False):
    """Step times in ms after `warmup` steps; `micro`: the micro-batch variant's part size."""
    torch.manual_seed(seed)
    net = make_net(form, dropout)
    adam = torch.optim.Adam(net.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(images.shape[0], generator=generator)
    micro = micro if variant == "micro-batch" else batch  # the last part may be smaller
    times = []
    profiler = None
    for i in range(steps):
        if profile and i == warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        idx = order[i * batch:(i + 1) * batch]
        x, y = images.index_select(0, idx), labels.index_select(0, idx)
        start = time.perf_counter()
        total = 0.0
        for part in range(0, batch, micro):
            xs, ys = x[part:part + micro], y[part:part + micro]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16"):
                out = forward(net, form, xs, variant == "checkpoint")
            loss = F.cross_entropy(out.float(), ys) * (xs.shape[0] / batch)
            loss.backward()
            total += loss.item()
        adam.step()
        adam.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - start) * 1e3)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        print(f"{form}, {variant}: busiest operators over {steps - warmup} steps")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    return times[warmup:]


# The example's flags of each variant; the micro-batch variant's size follows its flag.
FLAGS = {"plain": [], "bf16": ["--autocast", "bf16"], "checkpoint": ["--checkpoint"],
         "micro-batch": ["--micro-batch"]}
TORCH_ADAM = "plain, LibTorch's Adam"


def frugal_run(binary, variant, steps, threads, batch, extra, micro=16, warmup=WARMUP):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        subprocess.run([binary, "--model", "cnn", "--max-steps", str(steps), "--threads",
                        str(threads), "--batch", str(batch), "--eval-samples", "100",
                        "--quiet", "--report", report,
                        *FLAGS[variant], *([str(micro)] if variant == "micro-batch" else []),
                        *extra],
                       check=True, capture_output=True, text=True)
        return [r["time_ms"] for r in step_records(report)][warmup:]


def python_on_frugal_allocator(build, run):
    """`run()` with frugal's caching allocator serving this process's new CPU tensors
    (libfrugal_probe_capi.so, as twin.py loads it), then PyTorch's own again: what the
    allocator alone is worth."""
    probe = ctypes.CDLL(os.path.join(build, "bench", "libfrugal_probe_capi.so"))
    probe.frugal_probe_install()
    try:
        return run()
    finally:
        probe.frugal_probe_uninstall()


def engine_split(binary, steps, rounds, threads, batch):
    """frugal's CNN step split into kernels (the hand-written C++ loop) and frugal's own."""
    run = subprocess.run([binary, "--model", "cnn", "--batch", str(batch), "--steps", str(steps),
                          "--rounds", str(rounds), "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/torch2/examples/fashion_mnist")
    parser.add_argument("--engine", default="build/torch2/bench/bench_engine",
                        help="bench_engine, for the split into kernels and frugal's own")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64,
                        help="samples a step (above --micro-batch)")
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="samples a forward/backward in the micro-batch variant")
    add_warmup(parser)
    parser.add_argument("--variants", nargs="+", default=list(FLAGS) + [TORCH_ADAM],
                        choices=list(FLAGS) + [TORCH_ADAM])
    parser.add_argument("--profile", action="store_true",
                        help="print each Python form's busiest operators (plain variant)")
    parser.add_argument("--allocator", action="store_true",
                        help="also run the fastest Python form of the plain variant on frugal's "
                        "CPU allocator")
    args = parser.parse_args()
    check_warmup(parser, args)
    if not 0 < args.micro_batch < args.batch:
        parser.error(f"--micro-batch must be above 0 and below --batch {args.batch}, "
                     f"got {args.micro_batch}")
    torch.set_num_threads(args.threads)
    images, labels = load_fashion()
    sizes = {"micro": args.micro_batch, "warmup": args.warmup}

    def python_steps(form, variant, profile=False):
        return python_run(form, variant, images, labels, args.steps, args.batch, **sizes,
                          profile=profile)

    sides = ("frugal",) + FORMS
    times = {name: {side: [] for side in sides} for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            variant = name.split(",")[0]
            extra = ["--torch-optimizer"] if name == TORCH_ADAM else []
            times[name]["frugal"] += frugal_run(args.binary, variant, args.steps, args.threads,
                                                args.batch, extra, **sizes)
            for form in FORMS:
                times[name][form] += python_steps(form, variant)
    split = engine_split(args.engine, max(args.steps // 10, 1), max(3 * args.rounds, 1),
                         args.threads, args.batch)
    build = os.path.dirname(os.path.dirname(os.path.abspath(args.engine)))
    on_frugal = {}
    if args.allocator:
        for name in [v for v in args.variants if v == "plain"]:  # one is enough to say why
            form = min(FORMS, key=lambda f: statistics.median(times[name][f]))
            on_frugal[name] = statistics.median(
                python_on_frugal_allocator(build, lambda: python_steps(form, name)))
    if args.profile:
        for form in FORMS:
            python_steps(form, "plain", profile=True)

    def label(name):
        return f"micro-batch {args.micro_batch}" if name == "micro-batch" else name

    print(f"fashion_mnist against PyTorch in Python, same LibTorch ({torch.__version__}), "
          f"{args.threads} threads, CNN batch {args.batch}, Adam 1e-3, {args.rounds} rounds of "
          f"{args.steps} steps, medians of steps after {args.warmup} warm-up steps\n")
    print("| variant | frugal (ms/step) | PyTorch, modules | PyTorch, functional | "
          "fastest PyTorch | ratio to the fastest |")
    print("|---|---|---|---|---|---|")
    result = {"bench": "speed_twin", "torch": torch.__version__, "threads": args.threads,
              "rows": []}
    for name in args.variants:
        ms = {side: statistics.median(times[name][side]) for side in sides}
        fastest = min(FORMS, key=lambda form: ms[form])
        ratio = ms["frugal"] / ms[fastest]
        print(f"| {label(name)} | {ms['frugal']:.1f} | {ms['modules']:.1f} | "
              f"{ms['functional']:.1f} | "
              f"{fastest} | {ratio:.2f} |")
        result["rows"].append({"variant": label(name),
                               **{f"{side}_ms": ms[side] for side in sides},
                               "fastest": fastest, "ratio": ratio})
        if name in on_frugal:
            result["rows"][-1]["fastest_on_frugal_allocator_ms"] = on_frugal[name]
    if on_frugal:
        print("\nThe fastest PyTorch form again, its new CPU tensors from frugal's allocator: "
              + ", ".join(f"{name} {ms:.1f} ms" for name, ms in on_frugal.items()))
    hand, engine = split["hand_ms"], split["engine_ms"]
    print(f"\nfrugal's CNN step split (bench_engine, same CNN without dropout, batch {args.batch}): "
          f"{engine:.1f} ms under the Trainer = {hand:.1f} ms of kernels (the same step "
          f"hand-written in LibTorch C++) + {engine - hand:.2f} ms frugal's own "
          f"({(engine - hand) / engine * 100:.1f} %)")
    result["split"] = {"kernels_ms": hand, "trainer_ms": engine, "own_ms": engine - hand}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
