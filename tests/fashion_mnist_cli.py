#!/usr/bin/env python3
"""Checks the fashion_mnist example from the outside, on the real data set:
  micro-batch 16 against the full batch of 64 gives the same losses for 20 steps;
  a memory cap between the two peaks is survived by OOM recovery with the same losses;
  the same seed gives the same losses twice;
  bad command lines end with a clear message, a non-zero status and no stack trace.
Usage: fashion_mnist_cli.py PATH/TO/fashion_mnist WORK_DIR
"""
import json
import os
import subprocess
import sys

BINARY, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
failures = []


def check(condition, what):
    print(("ok   " if condition else "FAIL ") + what)
    if not condition:
        failures.append(what)


def train(name, *flags, steps=20):
    report = os.path.join(WORK, name + ".jsonl")
    cmd = [BINARY, "--model", "cnn", "--dropout", "0", "--seed", "3", "--max-steps", str(steps),
           "--threads", "2", "--quiet", "--report", report, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    rows = [json.loads(line) for line in open(report)]
    return [r for r in rows if r.get("event") != "eval"]


def same_losses(a, b, tolerance=1e-4):
    return len(a) == len(b) and all(abs(x["loss"] - y["loss"]) <= tolerance
                                         for x, y in zip(a, b))


full = train("full")
micro = train("micro16", "--micro-batch", "16")
check(same_losses(full, micro), "micro-batch 16 and the full batch of 64 give the same losses")
check(same_losses(full, train("again"), 0.0), "the same seed gives the same losses")

required = {"step", "epoch", "loss", "samples", "micro_batch", "micro_batches", "oom_retries",
            "skipped", "scale", "lr", "time_ms", "allocated_bytes", "peak_bytes",
            "reserved_bytes", "weights_bytes", "grads_bytes", "optimizer_bytes", "other_bytes"}
check(required <= set(full[0]), f"step reports carry {sorted(required)}")

# A cap below the full batch's peak but above the micro-batch's. At batch 64 the CNN's
# peak is Adam's step (its state and temporaries), which no micro-batch lowers; at 256 the
# activations set the peak.
big = train("big", "--batch", "256", steps=5)
big_micro = train("big_micro", "--batch", "256", "--micro-batch", "32", steps=5)
peak_full = max(r["peak_bytes"] for r in big)
peak_micro = max(r["peak_bytes"] for r in big_micro)
check(peak_micro < peak_full, f"micro-batch 32 of 256 peaks lower ({peak_micro} < {peak_full})")
capped = train("capped", "--batch", "256", "--memory-cap", str((peak_full + peak_micro) // 2), steps=5)
check(capped[0]["oom_retries"] > 0, f"the capped run retried its first step ({capped[0]['oom_retries']} retries, micro-batch {capped[0]['micro_batch']})")
check(same_losses(capped, big_micro), "the capped run's losses match the micro-batched run's")

for args, needle in [(["--data-dir", WORK], "cannot open"),
                     (["--bogus"], "--bogus"),
                     (["--batch", "-3"], "must be > 0, got -3"),
                     (["--model", "rnn"], "rnn")]:
    done = subprocess.run([BINARY, *args], capture_output=True, text=True)
    text = done.stdout + done.stderr
    check(done.returncode != 0 and needle in text and "frame #" not in text,
          f"{' '.join(args)}: non-zero exit and a clear message ({text.strip().splitlines()[0] if text.strip() else ''})")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
