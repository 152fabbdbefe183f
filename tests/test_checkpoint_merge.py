"""Model tensors assembled from several checkpoint tensors (metamat/checkpoint/merge.py):
the pieces' chunks placed in the assembled tensor (no byte read to assemble), ``Merge`` rules,
their errors, and loads of plain models from DCP and safetensors through them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import metamat
from metamat import Merge
from metamat.checkpoint import Chunk, MissingTensorError, ShapeMismatchError, TensorEntry
from metamat.checkpoint.merge import Assembly, assemble_entry, lookalikes


def test_merge_rule_validation():
    with pytest.raises(ValueError, match="stack_dim"):
        Merge("*.w", "*.e.{i}.w")
    with pytest.raises(ValueError, match="cat_dim"):
        Merge("*.w", ["*.a", "*.b"])
    with pytest.raises(ValueError, match="'\\*'"):
        Merge("*.w", "x.w")
    with pytest.raises(ValueError, match="every source"):
        Merge("*.w", ["*.{i}.a", "*.b"], stack_dim=0, cat_dim=0)
    with pytest.raises(ValueError, match="non-negative"):
        Merge("*.w", "*.{i}.a", stack_dim=-1)
    assert Merge("w", "v").sources == ("v",)


def test_chunks_are_placed_not_read():
    """Two segments of three stacked (2, 4) pieces, one saved in two row chunks: each chunk
    keeps its file and bytes, moved to its box in the (3, 4, 4) result."""
    src = {}
    for seg in "ab":
        for i in range(3):
            k = f"{seg}.{i}"
            e = TensorEntry(k, (2, 4), torch.float32)
            if seg == "b" and i == 1:  # saved as two chunks (e.g. DCP row shards)
                e.chunks += [Chunk("f", 800, 16, (0, 0), (1, 4)), Chunk("g", 0, 16, (1, 0), (1, 4))]
            else:
                e.chunks.append(Chunk("f", 100 * (i + 3 * (seg == "b")), 32, (0, 0), (2, 4)))
            src[k] = e
    a = Assembly("t", [[f"a.{i}" for i in range(3)], [f"b.{i}" for i in range(3)]], 0, 1)
    out = assemble_entry(a, src, (3, 4, 4))
    boxes = {(c.offsets, c.sizes): (c.file, c.byte_offset) for c in out.chunks}
    assert boxes[((2, 0, 0), (1, 2, 4))] == ("f", 200)       # a.2
    assert boxes[((0, 2, 0), (1, 2, 4))] == ("f", 300)       # b.0 after a's 2 rows
    assert boxes[((1, 2, 0), (1, 1, 4))] == ("f", 800)       # b.1, first chunk
    assert boxes[((1, 3, 0), (1, 1, 4))] == ("g", 0)         # b.1, second chunk
    assert sum(c.numel for c in out.chunks) == 3 * 4 * 4
    with pytest.raises(ShapeMismatchError, match=r"\(3, 4, 4\)"):
        assemble_entry(a, src, (3, 4, 5))
    with pytest.raises(MissingTensorError, match="2 of the 3"):
        assemble_entry(Assembly("t", [["a.0", "a.1"]], 0), src, (3, 2, 4))


def test_lookalikes():
    got = lookalikes(["m.layers.2.mlp.experts.gate_up_proj", "m.norm.weight"],
                     ["m.layers.2.moe.experts.0.w1.weight", "m.layers.3.moe.experts.0.w1.weight",
                      "m.layers.2.attn.q.weight"])
    assert got == {"m.layers.2.mlp.experts.gate_up_proj": ["m.layers.2.moe.experts.0.w1.weight"]}


class Experts(nn.Module):
    def __init__(self, e=5, r=3, c=4, device=None):
        super().__init__()
        self.up = nn.Parameter(torch.empty(e, 2 * r, c, device=device))
        self.down = nn.Parameter(torch.empty(e, c, r, device=device))
        self.qkv = nn.Linear(c, 3 * c, device=device)


def _pieces(e=5, r=3, c=4):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(e):
        sd[f"moe.{i}.w1"] = torch.randn(r, c, generator=g)
        sd[f"moe.{i}.w3"] = torch.randn(r, c, generator=g)
        sd[f"moe.{i}.w2"] = torch.randn(c, r, generator=g)
    for n in "qkv":
        sd[f"attn.{n}.weight"] = torch.randn(c, c, generator=g)
        sd[f"attn.{n}.bias"] = torch.randn(c, generator=g)
    return sd


RULES = [Merge("up", ["moe.{i}.w1", "moe.{i}.w3"], stack_dim=0, cat_dim=1),
         Merge("down", "moe.{i}.w2", stack_dim=0),
         Merge("qkv.*", ["attn.q.*", "attn.k.*", "attn.v.*"], cat_dim=0)]


def _want(sd, e=5):
    return {"up": torch.stack([torch.cat([sd[f"moe.{i}.w1"], sd[f"moe.{i}.w3"]]) for i in range(e)]),
            "down": torch.stack([sd[f"moe.{i}.w2"] for i in range(e)]),
            "qkv.weight": torch.cat([sd[f"attn.{n}.weight"] for n in "qkv"]),
            "qkv.bias": torch.cat([sd[f"attn.{n}.bias"] for n in "qkv"])}


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_plain_model_loads_through_merge_rules(tmp_path, fmt):
    sd = _pieces()
    if fmt == "safetensors":
        from safetensors.torch import save_file
        path = str(tmp_path / "m.safetensors")
        save_file(sd, path)
    else:
        import torch.distributed.checkpoint as dcp
        path = str(tmp_path / "dcp")
        dcp.save(sd, checkpoint_id=path, no_dist=True)
    m = Experts(device="meta")
    rep = metamat.materialize(m, path, merge=RULES)
    for k, v in _want(sd).items():
        assert torch.equal(m.get_parameter(k), v), k
    assert not rep.unexpected and rep.bytes_read == rep.bytes_needed
    assert rep.sources["qkv.bias"].startswith("checkpoint: 3 checkpoint tensors concatenated")
    # without the rules: the lookalikes are named, strict=False is not suggested
    with pytest.raises(MissingTensorError) as ei:
        metamat.materialize(Experts(device="meta"), path)
    assert "attn.q.weight" in str(ei.value) and "pass strict=False" not in str(ei.value)


def test_merge_argument_is_checked(tmp_path):
    from safetensors.torch import save_file

    save_file(_pieces(), str(tmp_path / "m.safetensors"))
    with pytest.raises(TypeError, match="merge"):
        metamat.materialize(Experts(device="meta"), str(tmp_path / "m.safetensors"),
                            merge="everything")
