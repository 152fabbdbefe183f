"""The staging pipeline (ring of buffers -> copies to destinations), used for CUDA
destinations: forced on CPU here to check its chunking, splitting and conversions bit for bit;
on a GPU (marked ``cuda``) into real CUDA tensors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from metamat.checkpoint import open_checkpoint
from metamat.load import load_targets, plan_load
from metamat.load.ops import split_ops
from test_load import expect, on_device, outside, same_bits, target


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("staged")
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(300, 70, generator=g), "v": torch.randn(50_000, generator=g),
          "h": torch.randn(33, 129, generator=g).to(torch.bfloat16)}
    save_file(sd, str(d / "m.safetensors"))
    dcp.save(sd, checkpoint_id=str(d / "dcp"))
    return sd, [str(d / "m.safetensors"), str(d / "dcp")]


def blocks(sd, dtype_of=lambda n, t: t.dtype, device="cpu"):
    specs = [("w", (0, 0), (300, 70), 0), ("w", (17, 5), (200, 41), 3),  # rows / CW slice
             ("v", (123,), (40_000,), 0), ("h", (2, 100), (30, 29), 1)]
    out = []
    for name, off, shape, pad in specs:
        t = target(name, sd[name], off, shape, dtype_of(name, sd[name]), row_pad=pad)
        t.tensor = on_device(t.tensor, device) if device != "cpu" else t.tensor
        out.append(t)
    return out


@pytest.mark.parametrize("staging", [1 << 18, 1 << 20, 256 << 20])
def test_staged_equals_the_checkpoint(ckpts, staging):
    sd, paths = ckpts
    for path in paths:
        with open_checkpoint(path) as ck:
            tg = blocks(sd)
            load_targets(tg, ck, staging_bytes=staging, staged=True, io_threads=2)
            for t in tg:
                assert same_bits(t.tensor, expect(sd[t.fqn], t.offsets, t.local_shape)), (path, t)
            # conversions happen in the reader's copy loop, before staging
            tg16 = blocks(sd, lambda n, x: torch.float16)
            load_targets(tg16, ck, staging_bytes=staging, staged=True, io_threads=2)
            for t in tg16:
                ref = expect(sd[t.fqn], t.offsets, t.local_shape).to(torch.float16)
                assert same_bits(t.tensor, ref), (path, t.fqn)


def test_staging_ring_time_is_reported(ckpts):
    sd, paths = ckpts
    with open_checkpoint(paths[0]) as ck:
        staged = load_targets(blocks(sd), ck, staging_bytes=1 << 20, staged=True)
        direct = load_targets(blocks(sd), ck, staging_bytes=1 << 20)
    assert 0 < staged.staging_seconds <= staged.seconds
    assert direct.staging_seconds == 0.0


def test_split_ops_bounds_every_piece(ckpts):
    sd, paths = ckpts
    with open_checkpoint(paths[0]) as ck:
        plan = plan_load(blocks(sd), ck)
        for cap in (64, 1000, 1 << 16):
            pieces = split_ops(plan.ops, cap)
            assert all(p.dst_row_bytes * p.rows <= cap for p in pieces)
            assert sum(p.src_bytes for p in pieces) == sum(o.src_bytes for o in plan.ops)


@pytest.mark.cuda
def test_cuda_destinations_through_pinned_ring(ckpts):
    sd, paths = ckpts
    for path in paths:
        with open_checkpoint(path) as ck:
            tg = blocks(sd, device="cuda")  # two of them row-padded views (strided copies)
            assert sum(not t.tensor.is_contiguous() for t in tg) == 2
            pads = [outside(t.tensor) for t in tg]
            load_targets(tg, ck, staging_bytes=1 << 20)
            for t, pad in zip(tg, pads):
                assert same_bits(t.tensor.cpu(), expect(sd[t.fqn], t.offsets, t.local_shape))
                assert same_bits(outside(t.tensor), pad), f"{t.fqn}: padding written"
