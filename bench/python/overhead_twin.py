"""Small steps against PyTorch in Python: bench_overhead's loops beside the same MLPs trained
in this Python process, alternating round by round in one run.

Each round runs `bench_overhead` once (its four C++ loops interleaved in `--inner` short
rounds of `--steps` steps, each starting one loop later: hand-written LibTorch, the Trainer,
the Trainer without the ledger, the Trainer with common policies), then the Python loops in
the same way: the MLP as `nn.Sequential` modules and as functional ops, each with
torch.optim.Adam's three implementations (the default per-parameter loop, foreach and
fused), each loop made once a round and timed in `--inner` short rounds in rotation. Short
interleaved rounds spread a noisy machine's slow spells over every loop alike. Each C++ row
is compared with the Python loop on the same Adam kernels (LibTorch's C++ Adam with the
per-parameter loop, the fused kernel with fused=True) and with the fastest Python loop of
all. Every loop zeroes with set_to_none, steps Adam 1e-3 and reads the loss as a number each
step; figures are medians over rounds of microseconds a step.

    python bench/python/overhead_twin.py --binary build/torch2/bench/bench_overhead \
        [--rounds 7] [--inner 20] [--steps 20] [--models 32-64-1 784-128-10] [--batches 1 8 32]
"""
import argparse
import json
import statistics
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP = 10


def shape_of(text):
    inputs, hidden, outputs = (int(v) for v in text.split("-"))
    return inputs, hidden, outputs


def make_modules(inputs, hidden, outputs):
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class FunctionalMLP(nn.Module):
    """The same two layers, parameters and initialisation; forward as two F.linear calls."""

    def __init__(self, inputs, hidden, outputs):
        super().__init__()
        net = make_modules(inputs, hidden, outputs)
        self.w1, self.b1 = net[0].weight, net[0].bias
        self.w2, self.b2 = net[2].weight, net[2].bias

    def forward(self, x):
        return F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2, self.b2)


def adam_kinds():
    kinds = {"loop": {"foreach": False}, "foreach": {"foreach": True}}
    try:  # fused Adam runs on the CPU from PyTorch 2.4
        torch.optim.Adam([nn.Parameter(torch.zeros(1))], fused=True).step()
        kinds["fused"] = {"fused": True}
    except (RuntimeError, TypeError):
        pass
    return kinds


def python_loop(model, batch, form, adam_kwargs):
    """One Python training loop's step, warmed up."""
    inputs, hidden, outputs = shape_of(model)
    torch.manual_seed(0)
    x = torch.randn(batch, inputs)
    y = torch.randint(0, outputs, (batch,)) if outputs > 1 else torch.randn(batch, outputs)
    loss_fn = F.cross_entropy if outputs > 1 else F.mse_loss
    torch.manual_seed(1)
    net = make_modules(inputs, hidden, outputs) if form == "modules" else FunctionalMLP(
        inputs, hidden, outputs)
    adam = torch.optim.Adam(net.parameters(), lr=1e-3, **adam_kwargs)

    def step():
        adam.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        adam.step()
        return loss.item()

    for _ in range(WARMUP):
        step()
    return step


def us_per_step(step, steps):
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1e6 / steps


def frugal_rows(binary, model, batch, inner, steps, threads):
    """bench_overhead's rows for one model and batch, one an optimizer it has."""
    run = subprocess.run([binary, "--rounds", str(inner), "--steps", str(steps), "--models", model,
                          "--batches", str(batch), "--threads", str(threads)],
                         check=True, capture_output=True, text=True)
    return {r["optimizer"]: r for r in json.loads(run.stdout.strip().splitlines()[-1])["rows"]}


# bench_overhead's optimizers and the Python Adam running the same kernels.
SAME_KERNELS = {"adam": "loop", "fused": "fused"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", default="build/torch2/bench/bench_overhead")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=20,
                        help="short interleaved rounds inside each round, on each side")
    parser.add_argument("--steps", type=int, default=20, help="steps of a short round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["32-64-1", "784-128-10"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = adam_kinds()
    loops = [(form, kind) for form in ("modules", "functional") for kind in kinds]
    keys = ("hand_us", "trainer_us", "trainer_no_ledger_us", "trainer_policies_us")

    print(f"Small MLP steps, Adam 1e-3, LibTorch {torch.__version__} on both sides, "
          f"{args.threads} thread(s), {args.rounds} rounds of {args.inner} x {args.steps} steps, "
          f"medians of the rounds in microseconds a step. PyTorch: the faster of the module and "
          f"functional forms with the same Adam kernels (C++ adam = Python's per-parameter "
          f"loop)\n")
    print("| model | batch | Adam | hand-written C++ | Trainer | x hand | frugal's own | "
          "Trainer + policies | PyTorch, same kernels | Trainer / PyTorch | fastest PyTorch | "
          "Trainer / fastest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in args.models:
        for batch in args.batches:
            cpp, py = {}, {loop: [] for loop in loops}
            for _ in range(args.rounds):
                for adam, row in frugal_rows(args.binary, model, batch, args.inner, args.steps,
                                             args.threads).items():
                    for key in keys:
                        cpp.setdefault(adam, {k: [] for k in keys})[key].append(row[key])
                steps = {loop: python_loop(model, batch, loop[0], kinds[loop[1]]) for loop in loops}
                inner = {loop: [] for loop in loops}
                for r in range(args.inner):
                    for i in range(len(loops)):
                        loop = loops[(i + r) % len(loops)]
                        inner[loop].append(us_per_step(steps[loop], args.steps))
                for loop, times in inner.items():
                    py[loop].append(statistics.median(times))
            p = {loop: statistics.median(v) for loop, v in py.items()}
            best = min(p, key=p.get)
            for adam, values in cpp.items():
                c = {key: statistics.median(v) for key, v in values.items()}
                same = [loop for loop in loops if loop[1] == SAME_KERNELS[adam] and loop in p]
                twin = min(same, key=p.get) if same else None
                twin_us = p[twin] if twin else float("nan")
                print(f"| {model} | {batch} | {adam} | {c['hand_us']:.1f} | {c['trainer_us']:.1f} | "
                      f"{c['trainer_us'] / c['hand_us']:.3f} | "
                      f"{c['trainer_us'] - c['hand_us']:.1f} | {c['trainer_policies_us']:.1f} | "
                      f"{twin_us:.1f} ({twin[0] if twin else '-'}) | "
                      f"{c['trainer_us'] / twin_us:.2f} | {p[best]:.1f} ({best[0]}, {best[1]}) | "
                      f"{c['trainer_us'] / p[best]:.2f} |")
                rows.append({"model": model, "batch": batch, "optimizer": adam, **c,
                             "python_same_kernels_us": twin_us,
                             "trainer_over_python": c["trainer_us"] / twin_us,
                             "fastest_python": f"{best[0]}, Adam {best[1]}",
                             "fastest_python_us": p[best],
                             "trainer_over_fastest_python": c["trainer_us"] / p[best]})
            rows[-1]["python_us"] = {f"{form}, {kind}": v for (form, kind), v in p.items()}
    print(json.dumps({"bench": "overhead_twin", "torch": torch.__version__,
                      "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
