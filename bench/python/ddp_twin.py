"""Data-parallel speed: frugal's ranks against PyTorch's Python DDP, side by side.

Four runs of the example's CNN (batch 64 global, Adam 1e-3, one intra-op thread a
process), alternated for several rounds:
  frugal 1 process      fashion_mnist --threads 1
  frugal 2 processes    fashion_mnist --distributed, two ranks
  PyTorch 1 process     this file's worker, in this process, no process group
  PyTorch DDP 2 procs   this file --worker, two ranks (gloo, DistributedDataParallel with
                        its default 25 MiB buckets)
The two ranks are started as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT on the loopback), without torchrun's own Python process.
Each figure is the median step time of rank 0 (forward, backward with the gradient
exchange, optimizer step, zeroing, reading the loss), after warm-up steps. Both sides
all-reduce the loss for their log outside the timed step. Scaling efficiency: samples/s
of 2 processes over twice those of 1.

    python bench/python/ddp_twin.py --binary build/torch2/examples/fashion_mnist \
        [--steps 200] [--rounds 2] [--batch 64] [--warmup 10]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reports import WARMUP, add_warmup, check_warmup, step_records  # noqa: E402
from speed_twin import cnn, load_fashion  # noqa: E402

BATCH = 64


def worker(steps, batch=BATCH, warmup=WARMUP):
    """Rank 0's step times in ms after `warmup` steps of `batch` samples (global); the ranks
    come from the environment."""
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    images, labels = load_fashion()
    torch.manual_seed(1)
    net = cnn(0.4)
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(steps):
        idx = torch.tensor_split(order[i * batch:(i + 1) * batch], world)[rank]
        x, y = images.index_select(0, idx), labels.index_select(0, idx)
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        adam.step()
        adam.zero_grad(set_to_none=True)
        value = loss.item()
        times.append((time.perf_counter() - start) * 1e3)
        if world > 1:  # the global batch's loss, for the log
            dist.all_reduce(torch.tensor([value * len(idx), float(len(idx))]))
    if world > 1:
        dist.destroy_process_group()
    return times[warmup:]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(cmd):
    """Runs `cmd` as ranks 0 and 1 of one job on the loopback, as torchrun would."""
    port = free_port()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for rank in range(2)]
    outputs = [p.communicate()[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} of {' '.join(cmd)} exited {p.returncode}:\n{out}")


def frugal_times(binary, ranks, steps, batch, warmup):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        cmd = [binary, "--model", "cnn", "--max-steps", str(steps), "--batch", str(batch),
               "--threads", "1", "--quiet", "--eval-samples", "100", "--report", report]
        if ranks > 1:
            two_ranks(cmd + ["--distributed"])
        else:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        return [r["time_ms"] for r in step_records(report)][warmup:]


def python_times(ranks, steps, batch, warmup):
    if ranks == 1:
        return worker(steps, batch, warmup)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        two_ranks([sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps),
                   "--batch", str(batch), "--warmup", str(warmup), "--out", out])
        with open(out) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/torch2/examples/fashion_mnist")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=BATCH, help="samples a step, all ranks")
    add_warmup(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    check_warmup(parser, args)
    if args.batch < 2:
        parser.error(f"--batch must be at least 2, a sample for each rank, got {args.batch}")
    if args.worker:
        times = worker(args.steps, args.batch, args.warmup)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.out, "w") as f:
                json.dump(times, f)
        return
    runs = {("frugal", 1): [], ("frugal", 2): [], ("PyTorch", 1): [], ("PyTorch", 2): []}
    for _ in range(args.rounds):
        for side, ranks in runs:
            sizes = (args.steps, args.batch, args.warmup)
            runs[(side, ranks)] += (frugal_times(args.binary, ranks, *sizes) if side == "frugal"
                                    else python_times(ranks, *sizes))
    ms = {key: statistics.median(values) for key, values in runs.items()}
    print(f"Data-parallel CNN, batch {args.batch} global, Adam, 1 thread a process, LibTorch "
          f"{torch.__version__}, gloo on the loopback; {args.rounds} rounds of {args.steps} "
          f"steps, medians after {args.warmup} warm-up steps\n")
    print("| run | ms/step | samples/s | scaling efficiency |")
    print("|---|---|---|---|")
    for side in ("frugal", "PyTorch"):
        for ranks in (1, 2):
            name = f"{side}, {ranks} process{'es' if ranks > 1 else ''}"
            if side == "PyTorch" and ranks == 2:
                name = "PyTorch DDP, 2 processes"
            rate = args.batch / ms[(side, ranks)] * 1e3
            eff = ms[(side, 1)] / (2 * ms[(side, 2)]) if ranks == 2 else None
            print(f"| {name} | {ms[(side, ranks)]:.1f} | {rate:.0f} | "
                  f"{'' if eff is None else f'{eff:.2f}'} |")
    print(f"\nfrugal / PyTorch DDP, 2 processes: {ms[('frugal', 2)] / ms[('PyTorch', 2)]:.2f}x "
          "ms/step")
    print(json.dumps({"bench": "ddp_twin", "torch": torch.__version__,
                      "ms": {f"{side}, {ranks}": v for (side, ranks), v in ms.items()}}))


if __name__ == "__main__":
    main()
