"""metamat.dtensor without a process group: N-D geometry, plain meta modules, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

import metamat
from metamat.checkpoint.errors import MissingTensorError, ShapeMismatchError
from metamat import UnsupportedError, materialize as materialize_dtensor
from metamat.models import has_dtensor
from metamat.blocks import row_blocks, view_shape


@st.composite
def boxes(draw):
    n = draw(st.integers(2, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(n)]
    offs, sizes = [], []
    for g in shape:
        o = draw(st.integers(0, g - 1))
        offs.append(o)
        sizes.append(draw(st.integers(1, g - o)))
    return shape, offs, sizes


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_row_blocks_tile_the_box(box):
    shape, offs, sizes = box
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    sl = tuple(slice(o, o + s) for o, s in zip(offs, sizes))
    local = ids[sl].reshape(-1)  # the box, row-major (how a local shard is stored)
    view = ids.reshape(view_shape(shape))
    seen = np.full(local.size, -1)
    for b in row_blocks(shape, offs, sizes):
        got = view[b.row:b.row + b.rows, b.col:b.col + b.cols].reshape(-1)
        seen[b.elem_offset:b.elem_offset + got.size] = got
    assert np.array_equal(seen, local)


def test_row_blocks_limit():
    with pytest.raises(ValueError, match="blocks"):
        row_blocks([100, 100, 4], [0, 0, 0], [100, 50, 4], limit=10)


class Conv(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 5, device=device)
        self.emb = nn.Embedding(6, 3, padding_idx=2, device=device)
        self.bn = nn.BatchNorm1d(4, device=device)


def test_plain_meta_module_init_and_nd_load(tmp_path):
    m = Conv(device="meta")
    assert not has_dtensor(m)
    rep = materialize_dtensor(m, seed=2, device="cpu")
    assert rep.source == "init" and rep.num_tensors == 8
    b = 1 / (3 * 5) ** 0.5
    assert m.conv.weight.abs().max() <= b and m.conv.bias.abs().max() <= b
    ref = torch.empty(12, 5)  # an N-D tensor fills as its (prod(shape[:-1]), shape[-1]) view
    metamat.fill_(ref, metamat.Uniform(-b, b), seed=2, key="conv.weight")
    assert torch.equal(m.conv.weight.detach().reshape(12, 5), ref)
    assert torch.equal(m.emb.weight[2], torch.zeros(3))
    assert torch.equal(m.bn.running_var, torch.ones(4)) and m.bn.num_batches_tracked.item() == 0
    m.conv(torch.randn(1, 3, 9)).sum().backward()

    sd = {k: v.detach() + 1 for k, v in Conv().state_dict().items()}
    sd["bn.num_batches_tracked"] = torch.tensor(5)
    save_file(sd, str(tmp_path / "c.safetensors"))
    m = Conv(device="meta")
    rep = materialize_dtensor(m, str(tmp_path / "c.safetensors"), device="cpu")
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert rep.read_amplification == 1.0 and rep.bytes_needed == rep.bytes_read


def test_errors_leave_model_unchanged(tmp_path):
    sd = {k: v.detach() for k, v in Conv().state_dict().items()}
    del sd["conv.bias"]
    save_file(sd, str(tmp_path / "c.safetensors"))
    m = Conv(device="meta")
    with pytest.raises(MissingTensorError, match="conv.bias"):
        materialize_dtensor(m, str(tmp_path / "c.safetensors"), device="cpu")
    assert all(p.is_meta for p in m.parameters())
    rep = materialize_dtensor(m, str(tmp_path / "c.safetensors"), strict=False, device="cpu")
    assert rep.initialized == ["conv.bias"] and not m.conv.bias.is_meta

    sd["conv.bias"] = torch.zeros(5)
    save_file(sd, str(tmp_path / "d.safetensors"))
    m = Conv(device="meta")
    with pytest.raises(ShapeMismatchError, match="conv.bias"):
        materialize_dtensor(m, str(tmp_path / "d.safetensors"), device="cpu")
    assert all(p.is_meta for p in m.parameters())

    bare = nn.Module()
    bare.w = nn.Parameter(torch.empty(3, 3, device="meta"))
    with pytest.raises(UnsupportedError, match="'w'"):
        materialize_dtensor(bare)
    assert bare.w.is_meta
    materialize_dtensor(bare, init={"w": metamat.Zeros()}, device="cpu")
    assert torch.equal(bare.w.detach(), torch.zeros(3, 3))


def test_rename_and_prefix(tmp_path):
    sd = {k: v.detach() for k, v in Conv().state_dict().items()}
    save_file({"model." + k: v for k, v in sd.items()}, str(tmp_path / "p.safetensors"))
    m = Conv(device="meta")
    rep = materialize_dtensor(m, str(tmp_path / "p.safetensors"), device="cpu")
    assert rep.key_prefixes == {"model": "model."}
    assert torch.equal(m.conv.weight.detach(), sd["conv.weight"])
    m = Conv(device="meta")
    materialize_dtensor(m, str(tmp_path / "p.safetensors"), rename=lambda k: "model." + k,
                        device="cpu")
    assert torch.equal(m.emb.weight.detach(), sd["emb.weight"])
