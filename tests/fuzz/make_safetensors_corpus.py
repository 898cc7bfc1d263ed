"""Writes the safetensors fuzzer's seed corpus: files as transformers, PEFT and the
safetensors package write them, for a GPT-2 small enough to keep in the repository.

    python tests/fuzz/make_safetensors_corpus.py tests/fuzz/safetensors_corpus
"""
import json
import os
import sys
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as tmp:
        # A sharded save: the index and its shards, as save_pretrained writes them.
        model.save_pretrained(tmp, max_shard_size="2KB")
        index = json.load(open(os.path.join(tmp, "model.safetensors.index.json")))
        shards = sorted(set(index["weight_map"].values()))
        for name in shards[:3]:  # the first few: the index names the rest, which stay missing
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v in shards[:3]}
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with tempfile.TemporaryDirectory() as tmp:
        peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"]))
        peft.save_pretrained(tmp)
        os.replace(os.path.join(tmp, "adapter_model.safetensors"),
                   os.path.join(out, "adapter_model.safetensors"))
        os.replace(os.path.join(tmp, "adapter_config.json"),
                   os.path.join(out, "adapter_config.json"))
    # Every dtype the format has, with metadata, from the safetensors package itself.
    tensors = {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "f16": torch.ones(2, dtype=torch.float16),
        "i64": torch.tensor([7]),
        "u8": torch.arange(5, dtype=torch.uint8),
        "b": torch.tensor([True, False]),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, os.path.join(out, "dtypes.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    main(sys.argv[1])
