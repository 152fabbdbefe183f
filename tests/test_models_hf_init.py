"""``materialize(hf_model, seed=...)`` initialises a transformers model as transformers does.

Each family is built eagerly (transformers' own init: the constructor, then ``post_init`` ->
``initialize_weights``) and on meta, then materialized by metamat. Every tensor must have the
eager tensor's statistics (constant tensors and computed buffers exactly), and the Report must
say which rule gave each value. The values are plan-invariant (test_models_hf_parallel.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from _hf_models import families, on_meta

transformers = pytest.importorskip("transformers")

import metamat  # noqa: E402


def _same_distribution(name: str, eager: torch.Tensor, ours: torch.Tensor) -> None:
    assert eager.shape == ours.shape and eager.dtype == ours.dtype, name
    a, b = eager.double().flatten(), ours.double().flatten()
    if not eager.is_floating_point() or a.numel() < 2 or float(a.std()) == 0.0:
        assert torch.equal(eager, ours), f"{name}: {a[:4]} vs {b[:4]}"
        return
    n, sa, sb = a.numel(), float(a.std()), float(b.std())
    assert abs(sa - sb) <= 6 * sa / math.sqrt(n) + 1e-7, f"{name}: std {sb:.5f}, eager {sa:.5f}"
    assert abs(float(a.mean()) - float(b.mean())) <= 6 * sa * math.sqrt(2 / n), \
        f"{name}: mean {float(b.mean()):.5f}, eager {float(a.mean()):.5f}"


@pytest.mark.parametrize("family", list(families()))
def test_statistics_equal_eager_init(family):
    cls, cfg = families()[family]
    torch.manual_seed(0)
    eager = cls(cfg)
    m = on_meta(cls, cfg)
    rep = metamat.materialize(m, seed=0)
    want, got = eager.state_dict(), m.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        _same_distribution(k, want[k], got[k])
    # every value came from the model's own init (no PyTorch default, no per-module reset)
    kinds = {v.split(":")[0] for v in rep.sources.values()}
    assert kinds <= {"model init", "model init (run)"}, kinds
    assert not rep.warnings


def _std(m, name):
    return float(dict(m.named_parameters())[name].detach().double().std())


def test_bert_values_the_issue_named():
    """BERT's embeddings and attention were PyTorch's default init (std 0.9986 / 0.0725 and a
    biased query.bias); now normal(0, initializer_range), zero biases, the padding row zero."""
    cls, cfg = families()["bert"]
    m = on_meta(cls, cfg)
    rep = metamat.materialize(m, seed=0)
    emb = "bert.embeddings.word_embeddings.weight"
    q = "bert.encoder.layer.0.attention.self.query"
    assert abs(_std(m, emb) - 0.02) < 0.002 and abs(_std(m, q + ".weight") - 0.02) < 0.002
    assert torch.equal(m.get_parameter(q + ".bias"), torch.zeros(128))
    assert torch.equal(m.get_parameter(emb)[0], torch.zeros(128))  # pad_token_id = 0
    assert rep.sources[emb] == ("model init: BertModel._init_weights: "
                                "Normal(mean=0.0, std=0.02), row 0 zeroed")
    assert rep.sources["bert.embeddings.position_ids"].startswith("model init (run)")
    assert torch.equal(m.bert.embeddings.position_ids, torch.arange(64).expand(1, -1))


def test_gpt2_scaled_residual_projections():
    cls, cfg = families()["gpt2"]
    m = on_meta(cls, cfg)
    rep = metamat.materialize(m, seed=0)
    want = 0.02 / math.sqrt(2 * cfg.n_layer)
    for i in range(cfg.n_layer):
        for p in (f"transformer.h.{i}.attn.c_proj.weight", f"transformer.h.{i}.mlp.c_proj.weight"):
            assert abs(_std(m, p) - want) < 0.1 * want, p
            assert rep.sources[p] == f"model init: GPT2Model._init_weights: Normal(mean=0.0, std={want!r})"
        assert abs(_std(m, f"transformer.h.{i}.attn.c_attn.weight") - 0.02) < 0.002


def test_t5_scaled_init():
    cls, cfg = families()["t5"]
    m = on_meta(cls, cfg)
    metamat.materialize(m, seed=0)
    a = "encoder.block.0.layer.0.SelfAttention."
    assert abs(_std(m, a + "q.weight") - (128 * 32) ** -0.5) < 0.1 * (128 * 32) ** -0.5
    assert abs(_std(m, a + "k.weight") - 128 ** -0.5) < 0.1 * 128 ** -0.5
    assert abs(_std(m, "shared.weight") - 1.0) < 0.05
    assert m.encoder.embed_tokens.weight is m.shared.weight


def test_tied_embedding_keeps_its_padding_row():
    """transformers ties lm_head to the embedding after init: the embedding's value wins,
    padding row included (the lm_head's own normal_ through the tied name is ignored)."""
    import transformers as T

    cfg = T.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=5,
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    eager = T.Qwen2ForCausalLM(cfg)
    assert torch.equal(eager.model.embed_tokens.weight[5], torch.zeros(32))
    m = on_meta(T.Qwen2ForCausalLM, cfg)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    rep = metamat.materialize(m, seed=0)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert torch.equal(m.lm_head.weight[5], torch.zeros(32))
    assert "row 5 zeroed" in rep.sources["model.embed_tokens.weight"]


def test_seeded_and_reproducible():
    cls, cfg = families()["mixtral"]
    runs = []
    for seed in (0, 0, 1):
        m = on_meta(cls, cfg)
        metamat.materialize(m, seed=seed)
        runs.append({k: v.clone() for k, v in m.state_dict().items()})
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not torch.equal(runs[0][gu], runs[2][gu])
    # with the fused engine's own values: metamat.fill_ of the global tensor, same key
    want = torch.empty_like(runs[0][gu])
    metamat.fill_(want.view(-1, want.shape[-1]), metamat.Normal(0.0, 0.02), seed=0, key=gu)
    assert torch.equal(runs[0][gu], want)


def test_init_empty_weights_and_init_override():
    """Parameters on meta, buffers real (kept); init= still wins over the model's init."""
    cls, cfg = families()["qwen2"]
    with metamat.init_empty_weights():
        m = cls(cfg)
    rep = metamat.materialize(m, seed=0, init={"lm_head.weight": metamat.Constant(0.5)})
    assert rep.sources["model.rotary_emb.inv_freq"] == "kept (real)"
    assert rep.sources["lm_head.weight"] == "init= distribution: Constant(value=0.5)"
    assert torch.equal(m.lm_head.weight, torch.full((512, 128), 0.5))
    assert abs(_std(m, "model.layers.0.mlp.up_proj.weight") - 0.02) < 0.002


def test_rotary_inv_freq_recomputed_exactly():
    cls, cfg = families()["mistral"]
    eager = cls(cfg)
    m = on_meta(cls, cfg)
    rep = metamat.materialize(m, seed=0)
    assert m.model.rotary_emb.inv_freq.device.type == "cpu"
    assert torch.equal(m.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
    assert rep.buffers["model.rotary_emb.inv_freq"] == "model init (run)"


def test_plain_modules_keep_pytorch_rules():
    """Outside a PreTrainedModel nothing changes: nn.Linear gets its reset_parameters()."""
    lin = torch.nn.Linear(16, 8, device="meta")
    rep = metamat.materialize(lin, seed=0)
    assert rep.sources["weight"] == "rule: Linear.reset_parameters: Uniform(a=-0.25, b=0.25)"
