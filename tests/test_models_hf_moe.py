"""Mixture-of-experts checkpoints whose layout differs from the model's (transformers 5).

transformers 5 keeps a MoE layer's experts fused (``mlp.experts.gate_up_proj``, ``down_proj``)
while its own ``save_pretrained`` writes one tensor per expert (Mixtral:
``block_sparse_moe.experts.N.w1/w2/w3``, router ``block_sparse_moe.gate``; Qwen2-MoE:
``mlp.experts.N.gate_proj/up_proj/down_proj``) and converts them back at load time. metamat
applies the model's own conversion rules (``merge="auto"``) or the user's ``metamat.Merge``
rules and must load bit for bit what ``from_pretrained`` loads; without them the error names
the lookalike tensors and never recommends random values for them. Parallel loads (TP, FSDP2,
each rank reading only its experts): test_models_hf_parallel.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from _hf_models import moe_classes, on_meta, save_moe

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("transformers < 5 keeps MoE experts as one module each (no fused experts, "
                "no conversion mapping)", allow_module_level=True)

import metamat  # noqa: E402
from metamat import Merge  # noqa: E402

INPUT = torch.tensor([[1, 5, 9, 33, 70, 2, 11]])


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def moe(request, tmp_path_factory):
    kind = request.param
    d = save_moe(kind, str(tmp_path_factory.mktemp(kind)))
    cls, cfg = moe_classes()[kind]
    ref = cls.from_pretrained(d).eval()
    return kind, d, cls, cfg, ref


def _files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def test_save_pretrained_writes_one_tensor_per_expert(moe):
    kind, d, cls, cfg, ref = moe
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        keys = json.load(f)["weight_map"]
    assert not any("gate_up_proj" in k for k in keys) and len(_files(d)) > 1
    assert any(".experts.3." in k for k in keys)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ref.state_dict()


def test_auto_loads_bit_exact(moe):
    kind, d, cls, cfg, ref = moe
    m = on_meta(cls, cfg())
    rep = metamat.materialize(m, d)
    want = ref.state_dict()
    got = m.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert not rep.unexpected and not rep.initialized
    with torch.no_grad():
        assert torch.equal(m.eval()(INPUT).logits, ref(INPUT).logits)
    gu = rep.sources["model.layers.1.mlp.experts.gate_up_proj"]
    assert gu.startswith("checkpoint: 8 checkpoint tensors stacked on dim 0 then concatenated "
                         "on dim 1") and "conversion mapping" in gu, gu
    if kind == "mixtral":  # the router is renamed (block_sparse_moe -> mlp)
        assert rep.sources["model.layers.0.mlp.gate.weight"] == \
            "checkpoint model.layers.0.block_sparse_moe.gate.weight"
    # every checkpoint byte read once: the pieces are read where they lie
    total = sum(os.path.getsize(os.path.join(d, f)) for f in _files(d))
    assert rep.bytes_needed == rep.bytes_read and rep.bytes_needed < total


def test_without_conversion_the_error_names_lookalikes(moe):
    kind, d, cls, cfg, ref = moe
    m = on_meta(cls, cfg())
    with pytest.raises(metamat.checkpoint.MissingTensorError) as ei:
        metamat.materialize(m, d, merge=None)
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts.gate_up_proj" in ei.value.names
    assert "look like" in msg and ".experts.0." in msg and "merge=" in msg
    assert "pass strict=False" not in msg and "random values" in msg
    assert all(p.is_meta for p in m.parameters())  # nothing changed


def test_strict_false_without_conversion_warns(moe):
    kind, d, cls, cfg, ref = moe
    m = on_meta(cls, cfg())
    with pytest.warns(UserWarning, match="strict=False initialised them with random values"):
        rep = metamat.materialize(m, d, merge=None, strict=False)
    assert "model.layers.0.mlp.experts.down_proj" in rep.initialized
    assert any(".experts.0." in k for k in rep.unexpected)


def _user_rules(kind):
    if kind == "mixtral":
        moe_ = "*.block_sparse_moe"
        return [Merge("*.mlp.experts.gate_up_proj", [f"{moe_}.experts.{{i}}.w1.weight",
                                                     f"{moe_}.experts.{{i}}.w3.weight"],
                      stack_dim=0, cat_dim=1),
                Merge("*.mlp.experts.down_proj", f"{moe_}.experts.{{i}}.w2.weight", stack_dim=0),
                Merge("*.mlp.gate.weight", f"{moe_}.gate.weight")]
    return [Merge("*.experts.gate_up_proj", ["*.experts.{i}.gate_proj.weight",
                                             "*.experts.{i}.up_proj.weight"],
                  stack_dim=0, cat_dim=1),
            Merge("*.experts.down_proj", "*.experts.{i}.down_proj.weight", stack_dim=0)]


def test_user_merge_rules_load_bit_exact(moe):
    kind, d, cls, cfg, ref = moe
    m = on_meta(cls, cfg())
    rep = metamat.materialize(m, d, merge=_user_rules(kind))
    want = ref.state_dict()
    assert all(torch.equal(want[k], v) for k, v in m.state_dict().items())
    assert "by Merge('*" in rep.sources["model.layers.0.mlp.experts.down_proj"]


def test_a_missing_expert_is_named(moe, tmp_path):
    """One expert's tensors absent: not loaded from the others, not initialised: named."""
    from safetensors.torch import save_file

    kind, d, cls, cfg, ref = moe
    sd = {k: v.contiguous() for k, v in _per_expert_state(d).items()
          if ".experts.3." not in k or ".layers.1." not in k}
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = on_meta(cls, cfg())
    with pytest.raises(metamat.checkpoint.MissingTensorError) as ei:
        metamat.materialize(m, str(tmp_path / "model.safetensors"))
    assert set(ei.value.names) == {"model.layers.1.mlp.experts.gate_up_proj",
                                   "model.layers.1.mlp.experts.down_proj"}
    assert "pass strict=False" not in str(ei.value)


def _per_expert_state(d):
    from safetensors.torch import load_file

    out = {}
    for f in _files(d):
        out.update(load_file(os.path.join(d, f)))
    return out


def test_a_wrong_expert_shape_is_a_shape_error(moe, tmp_path):
    from safetensors.torch import save_file

    kind, d, cls, cfg, ref = moe
    sd = _per_expert_state(d)
    k = next(k for k in sd if ".layers.0." in k and ".experts.2." in k)
    sd[k] = torch.zeros(sd[k].shape[0] + 1, sd[k].shape[1])
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = on_meta(cls, cfg())
    with pytest.raises(metamat.checkpoint.ShapeMismatchError, match="pieces stacked"):
        metamat.materialize(m, str(tmp_path / "model.safetensors"))


def test_fused_checkpoint_loads_as_is(moe, tmp_path):
    """A checkpoint already in the model's layout (e.g. its state_dict) needs no rule."""
    from safetensors.torch import save_file

    kind, d, cls, cfg, ref = moe
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()
               if k != "lm_head.weight" or not cfg().tie_word_embeddings},
              str(tmp_path / "fused.safetensors"))
    m = on_meta(cls, cfg())
    rep = metamat.materialize(m, str(tmp_path / "fused.safetensors"))
    assert rep.sources["model.layers.0.mlp.experts.gate_up_proj"] == "checkpoint"
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in m.state_dict().items())
