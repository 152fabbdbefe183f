"""A Hugging Face model built on meta and loaded from a local shard set (no hub, no network).

    python examples/hf_local_shards.py                         # a small Llama, made here
    python examples/hf_local_shards.py --model-dir DIR         # your save_pretrained folder

Without ``--model-dir`` a small ``LlamaForCausalLM`` is written with ``save_pretrained``
(several ``*.safetensors`` shards and ``model.safetensors.index.json``) to stand for a model
you downloaded. Then:

1. The model is built from its config under ``metamat.init_empty_weights()``: parameters on
   meta, buffers (the rotary ``inv_freq``) real. Nothing of the weights is allocated.
2. ``metamat.materialize(model, DIR)`` reads the index, every shard's header, then each
   tensor's bytes straight into freshly allocated parameters (tied weights stay tied).
3. The logits equal those of ``from_pretrained(DIR)`` on the same input, bit for bit.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import metamat


def write_small_llama(d: str) -> str:
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d, max_shard_size="100KB")
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="a local save_pretrained folder (default: a small "
                   "Llama written to a temporary folder)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.model_dir or write_small_llama(tmp)
        shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        print(f"{d}: {len(shards)} safetensors shards"
              f"{' + model.safetensors.index.json' if os.path.exists(os.path.join(d, 'model.safetensors.index.json')) else ''}")

        # 1. Build on meta from the config alone.
        config = AutoConfig.from_pretrained(d)
        with metamat.init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        assert all(p.is_meta for p in model.parameters())

        # 2. Allocate and load, reading only the bytes of the model's tensors.
        report = metamat.materialize(model, d, device="cpu")
        print(report)

        # 3. Same logits as transformers' own loader.
        x = torch.tensor([[1, 5, 9, 33, 70, 2, 11]]) % config.vocab_size
        with torch.no_grad():
            got = model.eval()(x).logits
            want = AutoModelForCausalLM.from_pretrained(d).eval()(x).logits
        same = torch.equal(got, want)
        print(f"logits equal to from_pretrained: {same}")
        print("OK" if same else "FAILED")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
