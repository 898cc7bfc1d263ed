#!/usr/bin/env python3
"""Checks the gan example from the outside, on Fashion-MNIST:
  frugal::Loop gives the hand-written LibTorch loop's losses bit for bit for 200 iterations,
  with one generator forward per iteration and the same BatchNorm batch counters;
  with the discriminator's blocks checkpointed, still bit for bit with the same counters;
  saved at iteration 100 and resumed in a new process, the rest bit for bit;
  bf16 autocast trains; fp16 with one loss scaler over both optimizers reports its scale;
  8-bit Adam states hold fewer optimizer bytes than Adam's, as the probe's ledger says;
  two ranks under --distributed (started as torchrun starts them) end with the same weights
  and give one process's losses within 1e-6 for 10 iterations (BatchNorm synchronized);
  a bad command line ends with a clear message and a non-zero status.
Usage: gan_cli.py PATH/TO/gan WORK_DIR
"""
import json
import math
import os
import re
import socket
import subprocess
import sys

from cli_check import check, finish

BINARY, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
ITERATIONS = 200


def run(name, *flags, iterations=ITERATIONS, width=8):
    report = os.path.join(WORK, name + ".jsonl")
    cmd = [BINARY, "--iterations", str(iterations), "--batch", "16", "--width", str(width),
           "--latent", "16", "--seed", "5", "--threads", "1", "--log-every", "1",
           "--report", report, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    losses = re.findall(r"d_loss (\S+) g_loss (\S+)", done.stdout)
    counters = re.search(r"generator forwards (\d+) generator batchnorm batches (\d+) "
                         r"discriminator batchnorm batches (\d+)", done.stdout)
    rows = [json.loads(line) for line in open(report)] if os.path.exists(report) else []
    return losses, tuple(int(c) for c in counters.groups()), rows


hand, hand_counters, _ = run("hand", "--hand")
ours, counters, rows = run("loop")
check(len(hand) == ITERATIONS and ours == hand,
      f"frugal::Loop gives the hand loop's losses bit for bit for {ITERATIONS} iterations")
check(counters == hand_counters == (ITERATIONS, 2 * ITERATIONS, 2 * 3 * ITERATIONS),
      f"one generator forward per iteration, the hand loop's BatchNorm counters {counters}")
check(len(rows) == ITERATIONS and all(r["grads_bytes"] == 0 for r in rows),
      "every iteration's report: both models stepped and released their gradients")

checkpointed, ck_counters, ck_rows = run("checkpoint", "--checkpoint")
check(checkpointed == hand, "with the discriminator's blocks checkpointed: still bit for bit")
check(ck_counters == hand_counters, f"and the same BatchNorm counters {ck_counters}")

half, _, _ = run("first-half", "--save", os.path.join(WORK, "gan.frugal"), iterations=ITERATIONS // 2)
rest, _, _ = run("second-half", "--resume", os.path.join(WORK, "gan.frugal"))
check(half == hand[:ITERATIONS // 2] and rest == hand[ITERATIONS // 2:],
      "saved at the half and resumed in a new process: the rest of the losses bit for bit")

bf16, _, _ = run("bf16", "--precision", "bf16", iterations=20)
check(len(bf16) == 20 and all(math.isfinite(float(d)) and math.isfinite(float(g)) for d, g in bf16),
      "bf16 autocast trains with finite losses")
done = subprocess.run([BINARY, "--iterations", "5", "--batch", "16", "--width", "8",
                       "--precision", "fp16", "--log-every", "1"], capture_output=True, text=True)
scales = re.findall(r"scale (\S+)", done.stdout)
if "is not supported by LibTorch" in done.stderr:  # LibTorch 1.13's CPU autocast: bf16 only
    check(done.returncode != 0 and "Half" in done.stderr,
          "fp16 on a LibTorch without fp16 CPU autocast: refused, naming it")
else:
    check(done.returncode == 0 and len(scales) == 5 and float(scales[0]) > 1,
          f"fp16 with one scaler over both optimizers reports its scale ({scales[:1]})")

# At the default width, where most tensors are large enough for 8-bit states.
_, _, adam = run("adam", iterations=3, width=32)
_, _, adam8 = run("adam8bit", "--optimizer", "adam8bit", iterations=3, width=32)
a, b = adam[-1]["optimizer_bytes"], adam8[-1]["optimizer_bytes"]
check(0 < b < a / 2, f"8-bit Adam states hold {b} optimizer bytes against Adam's {a}")

# Two ranks as torchrun starts them, each its half of every batch of 16, BatchNorm
# synchronized and the discriminator's blocks checkpointed: the whole batch's losses, as one
# process gives them. Over more iterations the GAN carries last-bit differences of summation
# order on and up (one process at 2 threads against 1 drifts apart as fast: 1.5e-4 by
# iteration 50), so the first 10 iterations are held to 1e-6.
RANKED = 10
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ranks = []
for rank in range(2):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks.append(subprocess.Popen(
        [BINARY, "--iterations", str(RANKED), "--batch", "16", "--width", "8", "--latent", "16",
         "--seed", "5", "--threads", "1", "--log-every", "1", "--distributed", "--checkpoint"],
        env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
outs = [r.communicate(timeout=300) for r in ranks]
sums = [re.search(r"parameters checksum (\S+)", o[0]) for o in outs]
check(all(r.returncode == 0 for r in ranks) and all(sums) and sums[0].group(1) == sums[1].group(1),
      f"--distributed: two ranks end with the same weights ({[m.group(1) if m else None for m in sums]})")
ranked = re.findall(r"d_loss (\S+) g_loss (\S+)", outs[0][0])
check(len(ranked) == RANKED and "d_loss" not in outs[1][0],
      "--distributed: rank 0 prints the iterations, rank 1 does not")
gap = max((abs(float(a) - float(b)) for r, o in zip(ranked, hand) for a, b in zip(r, o)),
          default=math.inf)
check(gap <= 1e-6, f"--distributed: the losses of one process within 1e-6 for {RANKED} "
      f"iterations (largest difference {gap:.3g})")

bad = subprocess.run([BINARY, "--precision", "fp8"], capture_output=True, text=True)
check(bad.returncode != 0 and "--precision" in bad.stderr + bad.stdout and "terminate" not in bad.stderr,
      "a bad --precision is named, with a non-zero status and no stack trace")
bad = subprocess.run([BINARY, "--device", "meta"], capture_output=True, text=True)
check(bad.returncode != 0 and "--device meta: only cpu and cuda" in bad.stderr
      and "Exception raised from" not in bad.stderr, "a bad --device is named")
finish()
