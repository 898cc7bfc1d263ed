"""The Python twin: the same models and variants with PyTorch's own tools
(torch.utils.checkpoint, torch.autocast), run beside frugal's bench_twin, same LibTorch.

CPU memory is measured the way frugal measures it: frugal's counting allocator, loaded
into this process through bench/python/probe_capi.cpp (libfrugal_probe_capi.so), counts
the bytes PyTorch's tensors request; the peak is reset before each step.

    python bench/python/twin.py --build build/torch2 [--steps 5] [--threads 2]
        [--blocks 8] [--width 256] [--hidden 2048] [--mlp-batch 256] [--cnn-batch 64]
"""
import argparse
import ctypes
import json
import statistics
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class ResidualBlock(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def residual_mlp(blocks=8, width=256, hidden=2048, outputs=10):
    return nn.Sequential(*[ResidualBlock(width, hidden) for _ in range(blocks)],
                         nn.Linear(width, outputs))


def cnn():
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Dropout(0.0)),
        nn.Linear(1024, 10))


def forward(net, x, checkpointed):
    if not checkpointed:
        return net(x)
    blocks = list(net)
    for block in blocks[:-1]:  # every block but the output layer, as frugal's bench_twin
        x = checkpoint(block, x, use_reentrant=False)
    return blocks[-1](x)


def run_python(row, steps, probe):
    """PyTorch's side of frugal's `row`: the same model, sizes and variant."""
    model, variant = row["model"], row["variant"]
    torch.manual_seed(0)
    mlp = model == "residual_mlp"
    x = torch.randn(row["batch"], row["width"]) if mlp else torch.rand(row["batch"], 1, 28, 28)
    y = torch.randint(0, 10, (x.shape[0],))
    torch.manual_seed(1)
    net = residual_mlp(row["blocks"], row["width"], row["hidden"]) if mlp else cnn()
    sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast_bf16"):
            out = forward(net, x, variant == "checkpoint")
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        sgd.step()
        sgd.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up: optimizer state exists from here
    times, peak, loss = [], 0, 0.0
    for _ in range(steps):
        probe.frugal_probe_reset_peak()
        start = time.perf_counter()
        loss = step()
        times.append((time.perf_counter() - start) * 1e3)
        peak = max(peak, probe.frugal_probe_peak())
    return {"side": "pytorch", "model": model, "variant": variant,
            "step_ms": statistics.median(times), "peak_bytes": peak, "loss": loss}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build/torch2", help="frugal's torch2 build folder")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    sizes = {"--blocks": 8, "--width": 256, "--hidden": 2048, "--mlp-batch": 256,
             "--cnn-batch": 64}
    for flag, default in sizes.items():
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = ctypes.CDLL(f"{args.build}/bench/libfrugal_probe_capi.so")
    probe.frugal_probe_peak.restype = ctypes.c_longlong
    probe.frugal_probe_allocated.restype = ctypes.c_longlong
    probe.frugal_probe_install()

    cmd = [f"{args.build}/bench/bench_twin", "--steps", str(args.steps)]
    for flag in sizes:
        cmd += [flag, str(getattr(args, flag[2:].replace("-", "_")))]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    frugal_rows = [json.loads(line) for line in
                   subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()]
    rows = []
    for f in frugal_rows:
        p = run_python(f, args.steps, probe)
        rows.append((f, p))

    print(f"Side by side, same LibTorch ({torch.__version__}), {torch.get_num_threads()} threads; "
          f"SGD with momentum; residual MLP {args.blocks}x{args.width}/{args.hidden} batch "
          f"{args.mlp_batch}, Fashion-MNIST CNN batch {args.cnn_batch}; "
          "peak = counted CPU bytes during a step\n")
    print("| model | variant | frugal ms | PyTorch ms | time ratio | frugal peak | PyTorch peak | peak ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for f, p in rows:
        print(f"| {f['model']} | {f['variant']} | {f['step_ms']:.1f} | {p['step_ms']:.1f} | "
              f"{f['step_ms'] / p['step_ms']:.2f} | {f['peak_bytes'] / 2**20:.2f} MiB | "
              f"{p['peak_bytes'] / 2**20:.2f} MiB | {f['peak_bytes'] / p['peak_bytes']:.2f} |")
    print()
    print(json.dumps([{"frugal": f, "pytorch": p} for f, p in rows]))


if __name__ == "__main__":
    main()
