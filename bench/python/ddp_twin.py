"""Data-parallel speed: frugal under torchrun against PyTorch's Python DDP, side by side.

Four runs of the example's CNN (batch 64 global, Adam 1e-3, one intra-op thread a
process), alternated for several rounds:
  frugal 1 process      fashion_mnist --threads 1
  frugal 2 processes    torchrun --nproc-per-node 2 --no-python fashion_mnist --distributed
  PyTorch 1 process     this file's worker, no process group
  PyTorch DDP 2 procs   torchrun --nproc-per-node 2 this file --worker (gloo,
                        DistributedDataParallel with its default 25 MiB buckets)
Each figure is the median step time of rank 0 (forward, backward with the gradient
exchange, optimizer step, zeroing, reading the loss), after warm-up steps. Both sides
all-reduce the loss for their log outside the timed step. Scaling efficiency: samples/s
of 2 processes over twice those of 1.

    python bench/python/ddp_twin.py --binary build/torch2/examples/fashion_mnist \
        [--steps 200] [--rounds 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reports import step_records  # noqa: E402
from speed_twin import DATA, WARMUP, cnn, load_idx  # noqa: E402

BATCH = 64


def worker(steps, out):
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    images = load_idx(f"{DATA}/train-images-idx3-ubyte.gz").unsqueeze(1).float().div_(255)
    labels = load_idx(f"{DATA}/train-labels-idx1-ubyte.gz").long()
    torch.manual_seed(1)
    net = cnn(0.4)
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(steps):
        idx = torch.tensor_split(order[i * BATCH:(i + 1) * BATCH], world)[rank]
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
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times[WARMUP:], f)
    if world > 1:
        dist.destroy_process_group()


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--standalone", *args]


def frugal_times(binary, steps, ranks):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        cmd = [binary, "--model", "cnn", "--max-steps", str(steps), "--threads", "1", "--quiet",
               "--eval-samples", "100", "--report", report]
        if ranks > 1:
            cmd = torchrun("--no-python", *cmd, "--distributed")
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return [r["time_ms"] for r in step_records(report)][WARMUP:]


def python_times(steps, ranks):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps),
               "--out", out]
        if ranks > 1:
            cmd = torchrun(*cmd[1:])
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return json.load(open(out))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/torch2/examples/fashion_mnist")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.out)
        return
    runs = {("frugal", 1): [], ("frugal", 2): [], ("PyTorch", 1): [], ("PyTorch", 2): []}
    for _ in range(args.rounds):
        for side, ranks in runs:
            get = frugal_times if side == "frugal" else python_times
            runs[(side, ranks)] += (get(args.binary, args.steps, ranks) if side == "frugal"
                                    else get(args.steps, ranks))
    ms = {key: statistics.median(values) for key, values in runs.items()}
    print(f"Data-parallel CNN, batch {BATCH} global, Adam, 1 thread a process, LibTorch "
          f"{torch.__version__}, gloo on the loopback; {args.rounds} rounds of {args.steps} "
          f"steps, medians after {WARMUP} warm-up steps\n")
    print("| run | ms/step | samples/s | scaling efficiency |")
    print("|---|---|---|---|")
    for side in ("frugal", "PyTorch"):
        for ranks in (1, 2):
            name = f"{side}, {ranks} process{'es' if ranks > 1 else ''}"
            if side == "PyTorch" and ranks == 2:
                name = "PyTorch DDP, 2 processes"
            rate = BATCH / ms[(side, ranks)] * 1e3
            eff = ms[(side, 1)] / (2 * ms[(side, 2)]) if ranks == 2 else None
            print(f"| {name} | {ms[(side, ranks)]:.1f} | {rate:.0f} | "
                  f"{'' if eff is None else f'{eff:.2f}'} |")
    print(f"\nfrugal / PyTorch DDP, 2 processes: {ms[('frugal', 2)] / ms[('PyTorch', 2)]:.2f}x "
          "ms/step")
    print(json.dumps({"bench": "ddp_twin", "torch": torch.__version__,
                      "ms": {f"{side}, {ranks}": v for (side, ranks), v in ms.items()}}))


if __name__ == "__main__":
    main()
