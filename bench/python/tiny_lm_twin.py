"""tiny_lm against its PyTorch-Python twin: the same character-level Transformer, data,
batches (the same permutation of the same sequences), AdamW and schedule, for time and
memory side by side in one run.

frugal's side is the `tiny_lm` example as a user runs it; PyTorch's side trains the same
model in this process with PyTorch's own tools (torch.utils.checkpoint, torch.autocast).
CPU memory on PyTorch's side is counted the way frugal counts it: frugal's counting
allocator, loaded through bench/python/probe_capi.cpp, with the peak reset before each
step. The two alternate, variant by variant, for several rounds; figures are medians of
the steps after the warm-up.

    python bench/python/tiny_lm_twin.py --build build/torch2 [--steps 60] [--rounds 2]
"""
import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from reports import WARMUP, add_warmup, check_warmup, step_records

PAD, START, VOCAB, IGNORE = 0, 1, 98, -100


def token_of(c):
    if c == "\n":
        return 97
    o = ord(c)
    return 2 + o - 32 if 32 <= o < 127 else -1


def read_fortunes(folder, max_len):
    names = sorted(n for n in os.listdir(folder)
                   if os.path.isfile(os.path.join(folder, n)) and "." not in n
                   and n not in ("art", "ascii-art"))
    out = []

    def keep(text):
        for at in range(0, len(text), max_len):
            piece = text[at:at + max_len]
            if len(piece) >= 8:
                out.append(piece)

    for name in names:
        text = []
        with open(os.path.join(folder, name), encoding="latin-1") as f:
            for line in f:
                line = line.rstrip("\n")
                if line == "%":
                    keep(text)
                    text = []
                    continue
                text += [t for t in map(token_of, line + "\n") if t >= 0]
        keep(text)
    return out


def make_batch(seqs, which):
    longest = max(len(seqs[i]) for i in which)
    inputs = torch.full((len(which), longest), PAD, dtype=torch.long)
    targets = torch.full((len(which), longest), IGNORE, dtype=torch.long)
    for r, i in enumerate(which):
        s = seqs[i]
        inputs[r, 0] = START
        inputs[r, 1:len(s)] = torch.tensor(s[:-1])
        targets[r, :len(s)] = torch.tensor(s)
    return inputs, targets, targets.eq(IGNORE)


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, activation="gelu")

    def forward(self, x, mask):
        return self.layer(x.transpose(0, 1), mask).transpose(0, 1)


class TinyLM(nn.Module):
    def __init__(self, max_len, dim, heads, layers, dropout):
        super().__init__()
        self.heads = heads
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x, padding, checkpointed):
        n = x.shape[1]
        h = self.drop((self.tokens(x) + self.positions(torch.arange(n)))
                      .masked_fill(padding.unsqueeze(-1), 0.0))
        mask = torch.full((n, n), float("-inf")).triu(1)
        for block in self.blocks:
            h = (checkpoint(block, h, mask, use_reentrant=False) if checkpointed
                 else block(h, mask))
        return self.head(self.norm(h))


def python_run(variant, seqs, train, args, probe):
    torch.manual_seed(args.seed)
    net = TinyLM(args.max_len, args.dim, args.heads, args.layers, args.dropout)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.01)
    warm = min(50, args.steps // 10)

    def factor(step):  # frugal's LrSchedule: linear warm-up, cosine to 0.1
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, args.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    micro = 8 if variant == "micro-batch 8" else args.batch
    times, peaks, losses = [], [], []
    for step in range(args.steps):
        which = [train[i] for i in order[step * args.batch:(step + 1) * args.batch].tolist()]
        x, y, pad = make_batch(seqs, which)
        total = int((~pad).sum())
        probe.frugal_probe_reset_peak()
        start = time.perf_counter()
        logged = 0.0
        for part in range(0, args.batch, micro):
            xs, ys, ps = x[part:part + micro], y[part:part + micro], pad[part:part + micro]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16"):
                logits = net(xs, ps, variant == "checkpoint")
            count = int((~ps).sum())
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ys.flatten()) * (count / total)
            loss.backward()
            logged += loss.item()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - start) * 1e3)
        peaks.append(probe.frugal_probe_peak())
        losses.append(logged)
    return times[args.warmup:], max(peaks), losses


FLAGS = {"plain": [], "checkpoint": ["--checkpoint"], "bf16": ["--autocast", "bf16"],
         "micro-batch 8": ["--micro-batch", "8"]}


def frugal_run(binary, variant, args):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.jsonl")
        subprocess.run([binary, "--max-steps", str(args.steps), "--threads", str(args.threads),
                        "--batch", str(args.batch), "--dim", str(args.dim), "--heads",
                        str(args.heads), "--layers", str(args.layers), "--max-len",
                        str(args.max_len), "--dropout", str(args.dropout), "--lr", str(args.lr),
                        "--seed", str(args.seed), "--eval-every", "0", "--eval-samples", "16",
                        "--quiet", "--report", report, *FLAGS[variant]],
                       check=True, capture_output=True, text=True)
        rows = step_records(report)
    return ([r["time_ms"] for r in rows][args.warmup:], max(r["peak_bytes"] for r in rows),
            [r["loss"] for r in rows])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", default="build/torch2")
    parser.add_argument("--data-dir", default="/usr/share/games/fortunes")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=1)
    add_warmup(parser)
    args = parser.parse_args()
    check_warmup(parser, args)
    torch.set_num_threads(args.threads)
    probe = ctypes.CDLL(f"{args.build}/bench/libfrugal_probe_capi.so")
    probe.frugal_probe_peak.restype = ctypes.c_longlong
    probe.frugal_probe_install()
    seqs = read_fortunes(args.data_dir, args.max_len)
    train = [i for i in range(len(seqs)) if i % 10 != 9]
    binary = f"{args.build}/examples/tiny_lm"

    res = {v: {"frugal": [[], 0, []], "pytorch": [[], 0, []]} for v in FLAGS}
    for _ in range(args.rounds):
        for v in FLAGS:
            for side, run in (("frugal", lambda: frugal_run(binary, v, args)),
                              ("pytorch", lambda: python_run(v, seqs, train, args, probe))):
                t, peak, losses = run()
                res[v][side][0] += t
                res[v][side][1] = max(res[v][side][1], peak)
                res[v][side][2] = losses
    print(f"tiny_lm against PyTorch in Python, same LibTorch ({torch.__version__}), "
          f"{args.threads} threads, batch {args.batch}, {args.layers} x {args.dim} wide, "
          f"sequences up to {args.max_len}, {args.rounds} rounds of {args.steps} steps, "
          f"medians after {args.warmup} warm-up steps\n")
    print("| variant | frugal ms/step | PyTorch ms/step | ratio | frugal step peak | "
          "PyTorch step peak | last loss frugal / PyTorch |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for v in FLAGS:
        f, p = res[v]["frugal"], res[v]["pytorch"]
        fm, pm = statistics.median(f[0]), statistics.median(p[0])
        print(f"| {v} | {fm:.1f} | {pm:.1f} | {fm / pm:.2f} | {f[1] / 2**20:.2f} MiB | "
              f"{p[1] / 2**20:.2f} MiB | {f[2][-1]:.4f} / {p[2][-1]:.4f} |")
        rows.append({"variant": v, "frugal_ms": fm, "pytorch_ms": pm, "frugal_peak_bytes": f[1],
                     "pytorch_peak_bytes": p[1], "frugal_loss": f[2][-1], "pytorch_loss": p[2][-1]})
    print(json.dumps({"bench": "tiny_lm_twin", "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
