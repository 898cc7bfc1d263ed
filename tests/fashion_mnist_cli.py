#!/usr/bin/env python3
"""Checks the fashion_mnist example from the outside, on the real data set:
  micro-batch 16 against the full batch of 64 gives the same losses for 20 steps;
  a memory cap between the two peaks is survived by OOM recovery with the same losses;
  the same seed gives the same losses twice;
  frugal's Adam gives LibTorch's losses with a lower peak, and so does the step in backward;
  factored 8-bit states without a first moment take a twentieth of the 8-bit ones, and train;
  a run saved and resumed (also after SIGTERM, also past a damaged newest save) continues
  the step numbers with the losses of a run never stopped;
  two ranks under --distributed (started as torchrun starts them) report the losses of one
  process on the whole batch, and only rank 0 speaks;
  --memory-timeline writes a step's page and says where, the step's figures the model's;
  bad command lines end with a clear message, a non-zero status and no stack trace.
Usage: fashion_mnist_cli.py PATH/TO/fashion_mnist WORK_DIR
"""
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

from cli_check import check, finish
import time

BINARY, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
# Every run's end-of-run evaluation on the first 1000 test images: the checks compare
# training losses, and the whole test set would be most of each run's time.
COMMON = ["--model", "cnn", "--dropout", "0", "--seed", "3", "--eval-samples", "1000"]


def train(name, *flags, steps=20):
    report = os.path.join(WORK, name + ".jsonl")
    cmd = [BINARY, *COMMON, "--max-steps", str(steps),
           "--threads", "1", "--quiet", "--report", report, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    rows = [json.loads(line) for line in open(report)]
    ends = [r for r in rows if r.get("event") == "end"]
    check(len(ends) == 1 and rows[-1] is ends[0] and ends[0]["status"] == "ok" and ends[0]["steps"] == steps,
          f"{name}: the report ends with one end-of-run record ({ends[-1] if ends else None})")
    check(len(done.stdout.strip().splitlines()) == 1, f"{name}: --quiet prints one line")
    return [r for r in rows if "event" not in r]


def held(folder):
    """The files of a save folder, less the lock file its writer takes (docs/fit-and-state.md)."""
    return sorted(n for n in os.listdir(folder) if n != ".lock")


def same_losses(a, b, tolerance=1e-4):
    return len(a) == len(b) and all(abs(x["loss"] - y["loss"]) <= tolerance
                                         for x, y in zip(a, b))


full = train("full")
micro = train("micro16", "--micro-batch", "16")
check(same_losses(full, micro), "micro-batch 16 and the full batch of 64 give the same losses")
check(same_losses(full, train("again"), 0.0), "the same seed gives the same losses")

# The memory timeline of step 2: the page and the peak's parts; the step's figures are the
# model's (the images are bytes, read on a thread of their own).
page = os.path.join(WORK, "step2.html")
done = subprocess.run([BINARY, *COMMON, "--max-steps", "3", "--threads", "1",
                       "--memory-timeline", page], capture_output=True, text=True)
check(done.returncode == 0 and os.path.getsize(page) > 1000
      and f"memory timeline of step 2 written to {page}" in done.stdout
      and "at the peak (" in done.stdout and "step 2: ledger weights" in done.stdout,
      f"--memory-timeline writes step 2's page and names it ({done.stdout.strip()[-300:]})")
allocated = [float(line.split("allocated ")[1].split(" MiB")[0])
             for line in done.stdout.splitlines() if line.startswith("step 2: cpu")]
check(len(allocated) == 1 and allocated[0] <= 60,
      f"allocated between steps is the model's, at most 60 MiB ({allocated})")

# frugal's Adam (the default) computes what LibTorch's does, without its temporaries; the
# step in backward also without holding all gradients.
torch_adam = train("torch_adam", "--torch-optimizer")
in_backward = train("in_backward", "--step-in-backward")
check(same_losses(full, torch_adam, 0.0), "frugal's Adam and LibTorch's give the same losses")
check(same_losses(full, in_backward, 1e-6), "the step in backward gives the same losses")
peak = {name: max(r["peak_bytes"] for r in rows)
        for name, rows in [("frugal", full), ("torch", torch_adam), ("in_backward", in_backward)]}
# What the step adds above what stays between steps (the data set, weights and state):
# gradients, activations and the optimizer's temporaries.
rise = {name: max(r["peak_bytes"] - r["allocated_bytes"] for r in rows)
        for name, rows in [("frugal", full), ("torch", torch_adam)]}
check(rise["frugal"] <= 0.95 * rise["torch"],
      f"frugal's Adam adds <= 0.95x of LibTorch's to the step ({rise['frugal']} / {rise['torch']})")
# In backward, the peak is the forward's plus the largest gradient (the dense layer's
# 1024 x 3136 floats, which autograd makes whole) and the update's scratch chunk.
largest_grad = 1024 * 7 * 7 * 64 * 4
forward_peak = max(r["forward_peak_bytes"] for r in in_backward)
check(peak["in_backward"] <= forward_peak + largest_grad + (1 << 20),
      f"the step in backward peaks at the forward's plus one gradient ({peak['in_backward']} <= {forward_peak} + {largest_grad} + 1 MiB)")
check(peak["in_backward"] < peak["frugal"], f"the step in backward peaks lower than the ordinary step ({peak['in_backward']} / {peak['frugal']}, {peak['in_backward'] / peak['torch']:.3f}x LibTorch's Adam)")
check(len(train("sgd", "--optimizer", "sgd", "--lr", "0.01", steps=3)) == 3, "--optimizer sgd trains")
# Factored second moments and no first moment: the CNN's matrices keep rows and columns only,
# its vectors (under 4096 elements) float32 moments.
eight = train("adamw8bit", "--optimizer", "adamw8bit", steps=3)
factored = train("factored", "--optimizer", "adamw8bit", "--factored", "--beta1", "0", steps=3)
state = {name: rows[-1]["optimizer_bytes"] for name, rows in [("8-bit", eight), ("factored", factored)]}
check(state["factored"] < 0.05 * state["8-bit"] and factored[-1]["loss"] < factored[0]["loss"],
      f"--factored --beta1 0 keeps < 0.05x of the 8-bit state ({state['factored']} / {state['8-bit']} B) and trains")
# 4-bit states: half a byte an element a moment and a scale a block of 128, against one byte
# and a scale a block of 256 (the CNN's vectors keep float32 moments either way).
four = train("adamw4bit", "--optimizer", "adamw4bit", steps=3)
state["4-bit"] = four[-1]["optimizer_bytes"]
check(state["4-bit"] < 0.6 * state["8-bit"] and four[-1]["loss"] < four[0]["loss"],
      f"--optimizer adamw4bit keeps < 0.6x of the 8-bit state ({state['4-bit']} / {state['8-bit']} B) and trains")

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
# The peaks are the training thread's; the cap is the process's, which also holds the images
# (read on a thread of their own): they are added.
images = big[0]["process_allocated_bytes"] - big[0]["allocated_bytes"]
capped = train("capped", "--batch", "256", "--memory-cap",
               str((peak_full + peak_micro) // 2 + images), steps=5)
check(capped[0]["oom_retries"] > 0, f"the capped run retried its first step ({capped[0]['oom_retries']} retries, micro-batch {capped[0]['micro_batch']})")
check(same_losses(capped, big_micro), "the capped run's losses match the micro-batched run's")

# Saving and resuming: 7 steps saved every 5 (and at the end), then a resumed run to 12,
# give the first 12 steps of the run never stopped, step numbers continued.
saves = os.path.join(WORK, "saves")
shutil.rmtree(saves, ignore_errors=True)
first = train("first7", "--save-dir", saves, "--save-every", "5", steps=7)
resumed = train("resumed12", "--save-dir", saves, "--resume", steps=12)
check([r["step"] for r in resumed] == list(range(8, 13)), "the resumed report goes on from step 8")
check(same_losses(first + resumed, full[:12], 0.0), "saved at 7 and resumed: the losses of the run never stopped")
check(held(saves) == [f"step-{n:012d}.frugal" for n in (5, 7, 12)], f"the newest 3 saves are kept ({held(saves)})")

# The newest save damaged: --resume warns and goes on from the one before.
newest = os.path.join(saves, "step-000000000012.frugal")
with open(newest, "r+b") as f:
    f.truncate(os.path.getsize(newest) // 2)
report = os.path.join(WORK, "fallback.jsonl")
done = subprocess.run([BINARY, *COMMON, "--max-steps", "9",
                       "--threads", "1", "--quiet", "--report", report, "--save-dir", saves, "--resume"],
                      capture_output=True, text=True)
fallback = [json.loads(line) for line in open(report) if '"event"' not in line]
check(done.returncode == 0 and "is truncated" in done.stderr and "resuming from the previous save" in done.stderr
      and [r["step"] for r in fallback] == [8, 9] and same_losses(fallback, full[7:9], 0.0),
      f"a damaged newest save: warned, resumed from step 7 ({done.stderr.strip().splitlines()[0] if done.stderr.strip() else ''})")

# SIGTERM: the step finishes, the state is saved, the exit status is 128 + 15; resumed, the
# run gives the losses of one never stopped.
term_saves = os.path.join(WORK, "term_saves")
shutil.rmtree(term_saves, ignore_errors=True)
report = os.path.join(WORK, "term.jsonl")
if os.path.exists(report):
    os.remove(report)
proc = subprocess.Popen([BINARY, *COMMON, "--max-steps", "1000",
                         "--threads", "1", "--quiet", "--report", report, "--save-dir", term_saves],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
while not (os.path.exists(report) and sum(1 for _ in open(report)) >= 3) and proc.poll() is None:
    time.sleep(0.01)
proc.send_signal(signal.SIGTERM)
out, err = proc.communicate(timeout=120)
term = [json.loads(line) for line in open(report)]
stopped = term[-1]["steps"]
check(proc.returncode == 128 + signal.SIGTERM and term[-1]["status"] == "stopped by signal 15"
      and held(term_saves) == [f"step-{stopped:012d}.frugal"],
      f"SIGTERM: exit {proc.returncode}, saved at step {stopped} ({out.strip()})")
if stopped + 2 <= len(full):
    after = train("after_term", "--save-dir", term_saves, "--resume", steps=stopped + 2)
    check(same_losses([r for r in term if "event" not in r] + after, full[:stopped + 2], 0.0),
          f"stopped by SIGTERM at step {stopped} and resumed: the losses of the run never stopped")
else:
    check(False, f"SIGTERM came late (step {stopped} of at most {len(full) - 2} compared)")

# Data-parallel: 2 ranks with 32 samples each give the losses of 1 process with 64 (the
# global batch's loss, reported by rank 0), with the variables torchrun sets.
def distributed(name, *flags):
    """Runs 2 ranks of the example as torchrun would; their outputs and rank 0's report."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = os.path.join(WORK, name + ".jsonl")
    ranks = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        ranks.append(subprocess.Popen(
            [BINARY, *COMMON, "--max-steps", "20",
             "--threads", "1", "--quiet", "--report", report, "--distributed", *flags], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [r.communicate(timeout=300) for r in ranks]
    check(all(r.returncode == 0 for r in ranks),
          f"{name}: both ranks finish ({outs[0][1]}{outs[1][1]})")
    check(outs[0][0].startswith("done: 20 steps") and outs[1][0] == "",
          f"{name}: rank 0 prints the result, rank 1 nothing")
    return [r for r in (json.loads(line) for line in open(report)) if "event" not in r]


# The ranks sum their halves in another order than one process sums the whole batch, and
# Adam's normalized steps carry such last-bit differences on from step to step (up to 5e-5 by
# step 17 on one machine, with LibTorch 2.15): the first steps are held to 1e-5, all 20 to the
# micro-batch check's 1e-4. A wrong average or a missing share is off by far more at once.
def as_one_process(ranked):
    return same_losses(full[:8], ranked[:8], 1e-5) and same_losses(full, ranked)


check(as_one_process(distributed("dist")),
      "--distributed: 2 ranks x 32 give the losses of 1 process x 64")
check(as_one_process(distributed("dist_zero2", "--zero", "2")),
      "--distributed --zero 2: the same losses with gradients and Adam's state sharded")
check(as_one_process(distributed("dist_zero3", "--zero", "3")),
      "--distributed --zero 3: the same losses with the weights sharded between steps too")
check(as_one_process(distributed("dist_zero3_in_backward", "--zero", "3", "--step-in-backward")),
      "--distributed --zero 3 --step-in-backward: the same losses, each rank's range updated "
      "in backward")

# An empty data set is refused when it is loaded, naming the file.
empty = os.path.join(WORK, "empty_set")
os.makedirs(empty, exist_ok=True)
for name, shape in [("train-images-idx3-ubyte.gz", [0, 28, 28]), ("train-labels-idx1-ubyte.gz", [0]),
                    ("t10k-images-idx3-ubyte.gz", [0, 28, 28]), ("t10k-labels-idx1-ubyte.gz", [0])]:
    with gzip.open(os.path.join(empty, name), "wb") as f:
        f.write(bytes([0, 0, 8, len(shape)]) + b"".join(s.to_bytes(4, "big") for s in shape))

for args, needle in [(["--data-dir", WORK], "cannot open"),
                     (["--data-dir", empty], "holds no images"),
                     (["--batch", str(2**63 - 1), "--max-steps", "1"], "larger than the training set"),
                     (["--lr", "inf"], "must be a finite number, got inf"),
                     (["--lr", "nan"], "must be a finite number"),
                     (["--seed", "-1"], "must be an integer from 0 to 2^64-1, got '-1'"),
                     (["--seed", str(2**64)], f"got '{2**64}'"),
                     (["--threads", "100000"], "100000"),
                     (["--memory-cap", "2000000", "--max-steps", "1"], "out of memory"),
                     (["--bogus"], "--bogus"),
                     (["--memory-timeline", "t.svg"], "not 't.svg'"),
                     (["--device", "tpu"], "--device tpu: not a device"),
                     (["--device", "meta"], "--device meta: only cpu and cuda"),
                     (["--device", "cuda:7", "--max-steps", "1"],
                      ("--device cuda:7: CUDA is not available", "--device cuda:7: no GPU 7 of")),
                     (["--distributed", "--max-steps", "1"], "WORLD_SIZE is not set"),
                     (["--zero", "1"], "--zero 1 needs --distributed"),
                     (["--resume"], "--resume and --save-every need --save-dir"),
                     (["--save-dir", saves, "--resume", "--model", "mlp", "--max-steps", "20"],
                      "does not fit this trainer"),
                     (["--lr-schedule", "cosine", "--warmup-steps", "50", "--max-steps", "10"],
                      "total_steps (10) must be greater than warmup_steps (50)"),
                     (["--batch", "-3"], "must be > 0, got -3"),
                     (["--model", "rnn"], "rnn"),
                     (["--factored", "--max-steps", "1"], "--factored needs a low-bit optimizer (adam8bit, adamw8bit, adam4bit, adamw4bit), not adam"),
                     (["--step-in-backward", "--torch-optimizer", "--max-steps", "1"], "frugal::optim::SGD, Adam or AdamW"),
                     # (LibTorch 1.13 refuses float16 autocast on the CPU before that.)
                     (["--step-in-backward", "--autocast", "fp16", "--max-steps", "1"],
                      ("'grad-scaler' needs every gradient", "Half needs LibTorch 2.4+"))]:
    done = subprocess.run([BINARY, *args], capture_output=True, text=True)
    text = done.stdout + done.stderr
    needles = needle if isinstance(needle, tuple) else (needle,)
    check(done.returncode != 0 and any(n in text for n in needles) and "frame #" not in text
          and "Exception raised from" not in text,
          f"{' '.join(args)}: non-zero exit and a clear message ({text.strip().splitlines()[0] if text.strip() else ''})")

finish()
