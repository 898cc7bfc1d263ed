#!/usr/bin/env python3
"""Checks the distill example from the outside, on Fashion-MNIST:
  the student distilled in micro-batches of 32 has the losses of whole batches of 128
  (exact accumulation), within float rounding;
  the frozen teacher is unchanged, and the student learns (test accuracy above chance by far);
  its Loop writes the memory timeline of the chosen iteration (LoopOptions::memory_timeline),
  as a PNG, without changing a loss;
  a bad command line ends with a clear message and a non-zero status.
Usage: distill_cli.py PATH/TO/distill WORK_DIR
"""
import os
import re
import subprocess
import sys

from cli_check import check, finish

BINARY = sys.argv[1]
WORK = sys.argv[2]
os.makedirs(WORK, exist_ok=True)


def run(*flags):
    cmd = [BINARY, "--teacher-steps", "100", "--steps", "60", "--batch", "128", "--seed", "2",
           "--threads", "1", "--log-every", "10", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


whole = run()
picture = os.path.join(WORK, "iteration3.png")
micro = run("--micro-batch", "32", "--memory-timeline", picture, "--memory-timeline-step", "3")
losses = lambda out: [float(x) for x in re.findall(r"step \d+ loss (\S+)", out)]  # noqa: E731
a, b = losses(whole), losses(micro)
check(len(a) == 6 and len(b) == 6 and all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(a, b)),
      f"micro-batches of 32 give the losses of whole batches of 128 ({a[-1]:.6f} / {b[-1]:.6f})")
with open(picture, "rb") as f:
    png = f.read()
check(f"memory timeline of step 3 written to {picture}" in micro and png[:8] == b"\x89PNG\r\n\x1a\n"
      and "at the peak" in micro, f"iteration 3's timeline written as a PNG of {len(png)} bytes")
accuracy = re.search(r"student accuracy (\S+) after 60 steps; teacher unchanged (\w+)", micro)
teacher = re.search(r"teacher accuracy (\S+)", micro)
check(accuracy is not None and accuracy.group(2) == "yes", "the frozen teacher is unchanged")
check(accuracy is not None and teacher is not None and float(accuracy.group(1)) > 0.6
      and float(teacher.group(1)) > 0.6,
      f"teacher and student learn ({teacher.group(1) if teacher else None}, "
      f"{accuracy.group(1) if accuracy else None})")
bad = subprocess.run([BINARY, "--alpha", "2"], capture_output=True, text=True)
check(bad.returncode != 0 and "--alpha" in bad.stderr + bad.stdout, "a bad --alpha is named")
bad = subprocess.run([BINARY, "--device", "tpu"], capture_output=True, text=True)
check(bad.returncode != 0 and "--device tpu: not a device" in bad.stderr, "a bad --device is named")
finish()
