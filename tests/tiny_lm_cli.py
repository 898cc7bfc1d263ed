#!/usr/bin/env python3
"""Checks the tiny_lm example from the outside, on Debian's fortunes:
  micro-batches of uneven token counts give the whole batch's losses for 10 steps;
  checkpointing its blocks (dropout on) gives bit-identical losses with a lower step peak;
  bf16 autocast trains with finite losses;
  bf16 weights with factored 8-bit AdamW states train with finite losses, and hold fewer
  weight and optimizer bytes than float32 AdamW;
  words (a vocabulary of 16384): the chunked loss head gives the plain head's losses with a
  step peak lower by at least 70 % of the logits and their gradient;
  bad command lines end with a clear message and a non-zero status.
Usage: tiny_lm_cli.py PATH/TO/tiny_lm WORK_DIR
"""
import json
import math
import os
import subprocess
import sys

from cli_check import check, finish

BINARY, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
SMALL = ["--dim", "64", "--heads", "4", "--layers", "2", "--max-len", "96", "--batch", "16",
         "--eval-every", "0", "--eval-samples", "64", "--threads", "1", "--seed", "5"]


def train(name, *flags, steps=10):
    report = os.path.join(WORK, name + ".jsonl")
    if os.path.exists(report):
        os.remove(report)
    # SMALL's options that `flags` give again are left out: the flags win.
    small = [v for i, v in enumerate(SMALL) if SMALL[i - i % 2] not in flags]
    cmd = [BINARY, *small, "--max-steps", str(steps), "--quiet", "--report", report, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout, done.stderr)
        raise SystemExit(f"FAIL {name}: exit {done.returncode}")
    rows = [json.loads(line) for line in open(report)]
    return [r for r in rows if r.get("event") != "eval"], done.stdout


whole, _ = train("whole", "--dropout", "0")
micro, _ = train("micro", "--dropout", "0", "--micro-batch", "5")
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(whole, micro))
counts = {r["count"] for r in whole}
check(len(whole) == 10 and len(micro) == 10 and all(r["micro_batches"] == 4 for r in micro),
      "10 steps each; micro-batch 5 runs batch 16 as 4 micro-batches (5, 5, 5, 1)")
check(len(counts) > 1, f"token counts differ from batch to batch ({min(counts)}..{max(counts)})")
check(diff < 1e-5, f"micro-batches give the whole batch's losses (largest difference {diff:.2e})")

plain, _ = train("plain", "--dropout", "0.1")
ckpt, _ = train("checkpoint", "--dropout", "0.1", "--checkpoint")
check([r["loss"] for r in plain] == [r["loss"] for r in ckpt],
      "checkpointed blocks give bit-identical losses with dropout on")
peak_plain = max(r["peak_bytes"] for r in plain)
peak_ckpt = max(r["peak_bytes"] for r in ckpt)
check(peak_ckpt < peak_plain,
      f"checkpointing lowers the step peak: {peak_ckpt / 2**20:.2f} MiB against "
      f"{peak_plain / 2**20:.2f} MiB (ratio {peak_ckpt / peak_plain:.3f})")

bf16, out = train("bf16", "--autocast", "bf16", steps=5)
check(all(math.isfinite(r["loss"]) for r in bf16) and "held-out perplexity" in out,
      "bf16 autocast trains with finite losses and reports the held-out perplexity")

adamw, _ = train("adamw", "--dropout", "0", steps=3)
low, _ = train("low", "--dropout", "0", "--optimizer", "adamw8bit", "--factored",
               "--weights", "bf16", steps=3)
check(all(math.isfinite(r["loss"]) for r in low) and low[-1]["loss"] < low[0]["loss"] + 0.5,
      f"bf16 weights, factored 8-bit AdamW: finite losses ({low[0]['loss']:.3f} .. "
      f"{low[-1]['loss']:.3f})")
check(low[-1]["weights_bytes"] * 2 <= adamw[-1]["weights_bytes"] + 4096 and
      low[-1]["optimizer_bytes"] * 4 < adamw[-1]["optimizer_bytes"],
      f"bf16 weights take {low[-1]['weights_bytes']} B against {adamw[-1]['weights_bytes']} B; "
      f"factored 8-bit states {low[-1]['optimizer_bytes']} B against "
      f"{adamw[-1]['optimizer_bytes']} B")

WORDS = ["--tokens", "words", "--vocab", "16384", "--max-len", "16", "--dropout", "0"]
plain_head, _ = train("words_plain", *WORDS, steps=4)
chunked_head, _ = train("words_chunked", *WORDS, "--loss-head", "chunked", "--loss-chunk", "32",
                        steps=4)
diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(plain_head, chunked_head))
check(len(plain_head) == len(chunked_head) == 4 and diff < 1e-4,
      f"words: the chunked head gives the plain head's losses (largest difference {diff:.2e})")
# The plain head's logits and their gradient, float32, over at least the scored tokens.
saved = min((p["peak_bytes"] - c["peak_bytes"]) / (2 * p["count"] * 16384 * 4)
            for p, c in zip(plain_head, chunked_head))
check(saved >= 0.7, f"words: the chunked head's step peak is lower by {saved:.2f}x the logits' "
      "and their gradient's bytes (at least 0.7)")

for flags, needle in [(["--autocast", "fp8"], "--autocast"),
                      (["--tokens", "bytes"], "--tokens"),
                      (["--tokens", "words", "--vocab", "3"], "--vocab"),
                      (["--dim", "66", "--heads", "4"], "not a multiple of --heads"),
                      (["--factored"], "--factored needs --optimizer adamw8bit"),
                      (["--weights", "fp8"], "--weights"),
                      (["--data-dir", os.path.join(WORK, "none")], "apt-get install fortunes"),
                      (["--device", "tpu"], "--device tpu: not a device")]:
    done = subprocess.run([BINARY, *flags], capture_output=True, text=True)
    check(done.returncode != 0 and needle in done.stderr and "Exception raised from" not in done.stderr,
          f"{' '.join(flags)} is refused with a message naming {needle!r}")

finish()
