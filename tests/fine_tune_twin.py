#!/usr/bin/env python3
"""The fine_tune example against transformers + PEFT, on the same checkpoint and data:
  a GPT-2 that transformers made and saved (save_pretrained, safetensors) loads into
  frugal's GPT-2 and gives transformers' logits;
  from PEFT's initial adapters, frugal's LoRA fine-tune gives PEFT's losses step by step;
  the adapters frugal saves load in PEFT (PeftModel.from_pretrained) and give frugal's
  logits, and their file is byte for byte what the safetensors package writes;
  QLoRA: the NF4 codes and double-quantized scales of the base are bitsandbytes' bit for
  bit, and its fine-tune ends within 2 % of LoRA's loss on the bf16 base;
  with lora_dropout, from the same seed, frugal draws PEFT's masks and gives its losses
  (when the binary's LibTorch is this Python's torch), checkpointed blocks the same;
  a truncated checkpoint and adapters of another rank are refused with a clear message;
  the random base fine_tune --write-base writes loads in transformers and gives frugal's logits.
Run with the Python that has transformers and peft (scripts/setup.sh installs them).
Usage: fine_tune_twin.py PATH/TO/fine_tune WORK_DIR [BINARY'S LIBTORCH VERSION]
"""
import json
import os
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_check import check, finish  # noqa: E402

BINARY, WORK = sys.argv[1], sys.argv[2]
SAME_TORCH = len(sys.argv) > 3 and torch.__version__.split("+")[0] == sys.argv[3]
FORTUNES = "/usr/share/games/fortunes"
SEQ, BATCH, STEPS, LR, RANK, ALPHA = 32, 4, 50, 1e-3, 4, 8
hf_logging.set_verbosity_error()
torch.set_num_threads(1)
shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)


def sequences():
    names = sorted(n for n in os.listdir(FORTUNES)
                   if os.path.isfile(os.path.join(FORTUNES, n)) and "." not in n
                   and n not in ("art", "ascii-art"))
    data = b"".join(open(os.path.join(FORTUNES, n), "rb").read() for n in names)
    n = len(data) // (SEQ + 1)
    return torch.frombuffer(bytearray(data[:n * (SEQ + 1)]), dtype=torch.uint8).view(n, SEQ + 1).long()


def batch_of(seqs, k):
    rows = [((k * BATCH + j) * 7919) % seqs.shape[0] for j in range(BATCH)]
    return seqs[rows]


def base_model():
    return GPT2LMHeadModel.from_pretrained(os.path.join(WORK, "base"), attn_implementation="eager")


def step_losses(report):
    """The losses of a fine_tune --report, step by step (not its event lines)."""
    rows = [json.loads(line) for line in open(report)]
    return [r["loss"] for r in rows if "event" not in r]


def run(*flags, ok=True):
    done = subprocess.run([BINARY, "--threads", "1", *flags], capture_output=True, text=True)
    if ok and done.returncode != 0:
        sys.exit(f"fine_tune {' '.join(flags)} failed:\n{done.stdout}{done.stderr}")
    return done


seqs = sequences()
probe = batch_of(seqs, 0)[:, :SEQ]

# The base: a small GPT-2 of random weights, as transformers saves it.
torch.manual_seed(0)
config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
GPT2LMHeadModel(config).save_pretrained(os.path.join(WORK, "base"))
model = base_model()
with torch.no_grad():
    base_logits = model(input_ids=probe).logits



def peft_fine_tune(peft):
    adapters = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(adapters, lr=LR, weight_decay=0.0)
    out = []
    for k in range(STEPS):
        rows = batch_of(seqs, k)
        logits = peft(input_ids=rows[:, :SEQ]).logits
        loss = F.cross_entropy(logits.reshape(-1, 256), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


# PEFT's initial adapters, then its fine-tune.
peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["c_attn"],
                                        lora_dropout=0.0))
peft.save_pretrained(os.path.join(WORK, "init"))
initial = [p.detach().clone() for p in peft.parameters() if p.requires_grad]
losses = peft_fine_tune(peft)

# frugal's fine-tune from the same start.
report = os.path.join(WORK, "frugal.jsonl")
out_dir = os.path.join(WORK, "frugal_adapters")
dump = os.path.join(WORK, "logits.safetensors")
common = ["--base", os.path.join(WORK, "base"), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
          "--targets", "c_attn", "--steps", str(STEPS), "--batch", str(BATCH), "--seq", str(SEQ),
          "--lr", str(LR)]
run(*common, "--init-adapters", os.path.join(WORK, "init"), "--report", report,
    "--save-adapters", out_dir, "--dump-logits", dump)
frugal_losses = step_losses(report)
dumped = load_file(dump)

check(torch.equal(dumped["inputs"], probe), "both sides read the same fortunes batch")
gap = (dumped["before"] - base_logits).abs().max().item()
check(gap <= 1e-5, f"frugal's GPT-2 from transformers' safetensors gives its logits (max gap {gap:.2e})")
worst = max((abs(a - b) for a, b in zip(frugal_losses, losses)), default=float("inf"))
check(len(frugal_losses) == STEPS and worst <= 1e-4,
      f"{STEPS} LoRA steps give PEFT's losses (worst gap {worst:.2e}; "
      f"{losses[0]:.4f} -> {losses[-1]:.4f})")
check(losses[-1] < losses[0] - 0.1, "the fine-tune lowers the loss")

# frugal's adapters in PEFT.
theirs = PeftModel.from_pretrained(base_model(), out_dir)
with torch.no_grad():
    peft_logits = theirs(input_ids=probe).logits
gap = (dumped["after"] - peft_logits).abs().max().item()
moved = (dumped["after"] - base_logits).abs().max().item()
check(gap <= 1e-5 and moved > 1e-3,
      f"PEFT loads frugal's adapters and gives frugal's logits (max gap {gap:.2e}; they moved {moved:.2e})")
written = os.path.join(out_dir, "adapter_model.safetensors")
again = os.path.join(WORK, "again.safetensors")
save_file(load_file(written), again, metadata={"format": "pt"})
check(open(written, "rb").read() == open(again, "rb").read(),
      "frugal writes the adapters' file byte for byte as the safetensors package does")

# Checkpointed blocks: the same losses.
ckpt_report = os.path.join(WORK, "checkpointed.jsonl")
run(*common, "--init-adapters", os.path.join(WORK, "init"), "--report", ckpt_report, "--checkpoint")
ckpt = step_losses(ckpt_report)
worst = max(abs(a - b) for a, b in zip(ckpt, frugal_losses))
check(len(ckpt) == STEPS and worst <= 1e-6, f"checkpointed blocks give the same losses (worst gap {worst:.2e})")

# LoRA dropout: PEFT's lora_dropout from the same adapters, its masks drawn from one seed.
DROPOUT, SEED = 0.1, 7
peft = get_peft_model(base_model(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["c_attn"],
                                               lora_dropout=DROPOUT))
with torch.no_grad():
    for p, v in zip([p for p in peft.parameters() if p.requires_grad], initial):
        p.copy_(v)
torch.manual_seed(SEED)
peft_dropped = peft_fine_tune(peft)
dropped = {}
for how in ("plain", "checkpointed"):
    dropped_report = os.path.join(WORK, f"dropout_{how}.jsonl")
    run(*common, "--init-adapters", os.path.join(WORK, "init"), "--lora-dropout", str(DROPOUT),
        "--seed", str(SEED), "--report", dropped_report, *(["--checkpoint"] if how == "checkpointed" else []))
    dropped[how] = step_losses(dropped_report)
moved = max(abs(a - b) for a, b in zip(dropped["plain"], frugal_losses))
check(len(dropped["plain"]) == STEPS and moved > 1e-3 and dropped["plain"][-1] < dropped["plain"][0] - 0.1,
      f"LoRA dropout changes the fine-tune (losses move up to {moved:.2e}) and it still learns "
      f"({dropped['plain'][0]:.4f} -> {dropped['plain'][-1]:.4f})")
worst = max(abs(a - b) for a, b in zip(dropped["checkpointed"], dropped["plain"]))
check(len(dropped["checkpointed"]) == STEPS and worst <= 1e-6,
      f"checkpointed blocks draw the same dropout masks again (worst gap {worst:.2e})")
if SAME_TORCH:
    worst = max(abs(a - b) for a, b in zip(dropped["plain"], peft_dropped))
    check(worst <= 1e-4, f"{STEPS} LoRA steps with dropout {DROPOUT} give PEFT's losses from the same seed "
                         f"(worst gap {worst:.2e})")
else:
    print(f"skipped: dropout's masks against PEFT's need the binary's LibTorch ({sys.argv[3:]}) "
          f"to be this torch ({torch.__version__})")

# QLoRA: the base in NF4 as bitsandbytes codes it; the fine-tune against LoRA on bf16.
import bitsandbytes.functional as bnbf  # noqa: E402

nf4_report = os.path.join(WORK, "nf4.jsonl")
bf16_report = os.path.join(WORK, "bf16.jsonl")
stored = os.path.join(WORK, "nf4_base.safetensors")
run(*common, "--base-format", "nf4", "--report", nf4_report, "--save-base", stored)
run(*common, "--base-format", "bf16", "--report", bf16_report)
codes = load_file(stored)
base_tensors = load_file(os.path.join(WORK, "base", "model.safetensors"))
matched, compared = 0, 0
for name, w in base_tensors.items():
    if not name.startswith("transformer.h.") or not name.endswith("weight") or w.dim() != 2:
        continue
    q, st = bnbf.quantize_4bit(w.t().contiguous().to(torch.bfloat16), blocksize=64, quant_type="nf4",
                               compress_statistics=True)
    prefix = name[:-len("weight")]
    compared += 1
    matched += int(torch.equal(q.view(-1), codes[prefix + "weight_nf4"])
                   and torch.equal(st.absmax, codes[prefix + "weight_nf4_absmax"])
                   and torch.equal(st.state2.absmax, codes[prefix + "weight_nf4_absmax2"])
                   and torch.equal(st.offset.view(1), codes[prefix + "weight_nf4_offset"]))
check(compared == 8 and matched == compared,
      f"the NF4 codes and double-quantized scales are bitsandbytes' bit for bit ({matched} of {compared} matrices)")
nf4 = step_losses(nf4_report)
bf16 = step_losses(bf16_report)
gap = abs(nf4[-1] - bf16[-1]) / bf16[-1]
check(len(nf4) == STEPS and gap <= 0.02 and nf4[-1] < nf4[0] - 0.1,
      f"QLoRA's last loss is within 2 % of LoRA's on the bf16 base ({nf4[-1]:.4f} against {bf16[-1]:.4f}, "
      f"{100 * gap:.2f} %)")

# Full fine-tuning (every parameter, frugal's leanest optimizer): with the blocks' weights as
# 8-bit codes it lowers the loss as with float32 weights.
full = {}
for fmt in ("float32", "int8"):
    full_report = os.path.join(WORK, f"full_{fmt}.jsonl")
    run(*common, "--full", "--base-format", fmt, "--compute", "float32", "--report", full_report)
    full[fmt] = step_losses(full_report)
gap = abs(full["int8"][-1] - full["float32"][-1]) / full["float32"][-1]
check(len(full["int8"]) == STEPS and full["int8"][-1] < full["int8"][0] - 0.5 and gap <= 0.02,
      f"full fine-tuning on 8-bit weights lowers the loss as on float32 weights ({full['int8'][0]:.4f} to "
      f"{full['int8'][-1]:.4f} against {full['float32'][-1]:.4f}, {100 * gap:.2f} %)")

# Refusals: a truncated checkpoint, adapters of another rank.
broken = os.path.join(WORK, "broken")
shutil.copytree(os.path.join(WORK, "base"), broken)
weights = os.path.join(broken, "model.safetensors")
data = open(weights, "rb").read()
open(weights, "wb").write(data[:len(data) - 100])
done = run("--base", broken, "--steps", "1", ok=False)
check(done.returncode == 1 and "is not a whole safetensors file" in done.stderr
      and "Traceback" not in done.stderr and "frame #" not in done.stderr,
      f"a truncated checkpoint is refused: {done.stderr.strip()[:160]}")
done = run(*common[:2], "--lora-rank", "8", "--init-adapters", out_dir, "--steps", "1", ok=False)
check(done.returncode == 1 and "r is 4 in the file and 8 here" in done.stderr,
      f"adapters of another rank are refused: {done.stderr.strip()[:160]}")
done = run(*common[:2], "--full", "--save-adapters", os.path.join(WORK, "none"), ok=False)
check(done.returncode == 1 and "leave out --save-adapters" in done.stderr
      and not os.path.exists(os.path.join(WORK, "none")),
      f"a full fine-tune asked to save adapters is refused before it trains: {done.stderr.strip()[:160]}")

# A config.json that does not describe the checkpoint, or describes no model, is refused by
# name: no SIGFPE, no half-loaded model; flags out of range likewise.
def edited_base(name, **changes):
    folder = os.path.join(WORK, name)
    shutil.copytree(os.path.join(WORK, "base"), folder)
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return folder


for name, changes, expected in [
        ("no_heads", {"n_head": 0}, "n_head must be a whole number from 1 to 2^31, got 0"),
        ("odd_heads", {"n_head": 3}, "3 heads do not divide 64 embedding dimensions"),
        ("text_heads", {"n_head": "4"}, "n_head must be a whole number from 1 to 2^31, got string"),
        ("one_layer", {"n_layer": 1}, "beyond the 1 blocks its config.json gives (n_layer)")]:
    done = run("--base", edited_base(name, **changes), "--steps", "1", ok=False)
    check(done.returncode == 1 and expected in done.stderr,
          f"a config.json with {changes} is refused: {done.stderr.strip()[:160]}")
# The base --write-base makes, as transformers would load it; then the fine-tune on it, as
# the README prints it (NF4 base, adapters saved).
tiny = os.path.join(WORK, "tiny")
done = run("--write-base", tiny, "--embd", "32", "--layers", "2", "--heads", "2",
           "--base-format", "nf4", "--steps", "3", "--batch", "2", "--seq", str(SEQ),
           "--save-adapters", os.path.join(WORK, "written_adapters"))
theirs = GPT2LMHeadModel.from_pretrained(tiny, attn_implementation="eager")
with torch.no_grad():
    their_logits = theirs(input_ids=batch_of(seqs, 0)[:2, :SEQ]).logits
# NF4 changes the blocks' weights: the tiny float32 base is compared through a float32 run.
run("--base", tiny, "--steps", "0", "--batch", "2", "--seq", str(SEQ),
    "--dump-logits", os.path.join(WORK, "written_f32.safetensors"))
exact = load_file(os.path.join(WORK, "written_f32.safetensors"))["before"]
gap = (exact - their_logits).abs().max().item()
check(theirs.config.n_layer == 2 and theirs.config.n_embd == 32 and gap <= 1e-5
      and "wrote a random GPT-2" in done.stdout
      and os.path.exists(os.path.join(WORK, "written_adapters", "adapter_model.safetensors")),
      f"transformers loads the base fine_tune --write-base writes and gives its logits "
      f"(max gap {gap:.2e}), and the NF4 fine-tune on it saves adapters")
for flags, expected in [(["--random-base", "--heads", "0"], "heads must be >= 1, got 0"),
                        (["--random-base", "--heads", "5"], "5 heads do not divide 64"),
                        (["--seed", "-1"], "must be a whole number >= 0, got -1"),
                        (["--threads", "100000"], "100000")]:
    done = subprocess.run([BINARY, *flags, "--steps", "1"], capture_output=True, text=True)
    check(done.returncode > 0 and expected in done.stdout + done.stderr,
          f"fine_tune {' '.join(flags)} is refused (exit {done.returncode}): "
          f"{(done.stdout + done.stderr).strip()[:160]}")
finish()
