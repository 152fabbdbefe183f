"""Small Hugging Face transformers models from local configs (no hub): the families the HF
tests try (GPT-2, BERT, T5, Qwen2, Mistral, Mixtral, Qwen2-MoE), and helpers to build them on
meta and to save them with ``save_pretrained``."""
from __future__ import annotations

import os
from typing import Callable, Dict, Tuple

import torch


def families() -> Dict[str, Tuple[Callable, object]]:
    """name -> (model class, config): big enough for statistics, small enough to build in
    well under a second."""
    import transformers as T

    return {
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(
            vocab_size=512, n_positions=64, n_embd=128, n_layer=4, n_head=4,
            bos_token_id=0, eos_token_id=0)),
        "bert": (T.BertForMaskedLM, T.BertConfig(
            vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, max_position_embeddings=64, pad_token_id=0)),
        "t5": (T.T5ForConditionalGeneration, T.T5Config(
            vocab_size=512, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
            relative_attention_num_buckets=64, decoder_start_token_id=0, pad_token_id=0)),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=3)),
        "mistral": (T.MistralForCausalLM, T.MistralConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, pad_token_id=3)),
        "mixtral": (T.MixtralForCausalLM, mixtral_config(hidden=128, inter=192, vocab=512)),
        "qwen2_moe": (T.Qwen2MoeForCausalLM, qwen2_moe_config(hidden=128, inter=96, vocab=512)),
    }


def mixtral_config(hidden: int = 32, inter: int = 48, vocab: int = 96, experts: int = 4):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=experts, num_experts_per_tok=2,
                         max_position_embeddings=64)


def qwen2_moe_config(hidden: int = 32, inter: int = 24, vocab: int = 96, experts: int = 4):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * inter,
                          moe_intermediate_size=inter, shared_expert_intermediate_size=2 * inter,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          num_experts=experts, num_experts_per_tok=2, max_position_embeddings=64)


def moe_classes():
    import transformers as T

    return {"mixtral": (T.MixtralForCausalLM, mixtral_config),
            "qwen2_moe": (T.Qwen2MoeForCausalLM, qwen2_moe_config)}


def on_meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


def save_moe(kind: str, d: str, shard: str = "40KB") -> str:
    """``save_pretrained`` of a small MoE model of ``kind`` (several shards + index): the
    checkpoint holds one tensor per expert, the model fused experts."""
    cls, cfg = moe_classes()[kind]
    torch.manual_seed(0)
    m = cls(cfg())
    with torch.no_grad():  # routers and norms away from their init, so a wrong load shows
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    m.save_pretrained(d, max_shard_size=shard)
    assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    return d
