"""Loading targets from real checkpoints (written by torch / safetensors), bit-exact.

Planning tests are pure Python; load tests need metamat._C (the C++ reader).
"""
from __future__ import annotations

import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from metamat.checkpoint import (CheckpointError, CoverageError, DestinationError,
                                DtypeMismatchError, MissingTensorError, ShapeMismatchError,
                                TruncatedFileError, open_checkpoint)
from metamat.checkpoint.base import Checkpoint, Chunk, TensorEntry
from metamat.load import load_targets, plan_load
from metamat.plan import Target

POISON = {torch.float32: float("nan"), torch.float16: float("nan"),
          torch.bfloat16: float("nan"), torch.int64: -7, torch.int32: -7}


def target(fqn, full: torch.Tensor, offsets, shape, dtype=None, row_pad=0) -> Target:
    """A target for block ``offsets``/``shape`` of ``full``, poisoned; ``row_pad`` extra
    elements per row make the destination a strided view."""
    dtype = dtype or full.dtype
    if len(shape) == 2 and row_pad:
        store = torch.full((shape[0], shape[1] + row_pad), POISON[dtype], dtype=dtype)
        t = store[:, : shape[1]]
    else:
        t = torch.full(tuple(shape), POISON[dtype], dtype=dtype)
    return Target(fqn, fqn, tuple(full.shape), tuple(offsets), tuple(shape), dtype, tensor=t)


def on_device(x: torch.Tensor, device) -> torch.Tensor:
    """``x`` on ``device`` laid out as on the host: its whole storage copied (a row-padded
    view's poisoned padding included) and viewed with the same shape, strides and offset
    (``x.to(device)`` would give a contiguous copy: no strided destination)."""
    n = x.untyped_storage().nbytes() // x.element_size()
    flat = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (n,), (1,))
    return flat.to(device).as_strided(x.shape, x.stride(), x.storage_offset())


def outside(x: torch.Tensor) -> torch.Tensor:
    """The elements of ``x``'s storage that ``x`` does not view (its padding), on the host."""
    n = x.untyped_storage().nbytes() // x.element_size()
    flat = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), 0, (n,),
                                                                (1,))
    keep = torch.ones(n, dtype=torch.bool, device=x.device)
    keep.as_strided(x.shape, x.stride(), x.storage_offset()).fill_(False)
    return flat[keep].cpu()


def expect(full, offsets, shape):
    idx = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
    return full[idx]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8) if a.dim() else a, b.contiguous().view(torch.uint8)
        if b.dim() else b)


def state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(37, 11, generator=g),
        "vec": torch.randn(23, generator=g),
        "ids": torch.randint(0, 1 << 40, (9, 3), generator=g),
        "half": torch.randn(8, 5, generator=g).half(),
    }


def blocks(full):
    """Row blocks, column blocks, odd interior blocks, the whole tensor, one element."""
    if full.dim() == 1:
        n = full.shape[0]
        return [((0,), (n,)), ((3,), (n - 5,)), ((n - 1,), (1,)), ((4,), (0,))]
    r, c = full.shape
    return [((0, 0), (r, c)), ((r // 4, 0), (r // 2, c)), ((0, c // 3), (r, c - c // 3 - c // 4)),
            ((r // 3, c // 4), (max(1, r - r // 3 - 1), max(1, c - c // 4 - 1))),
            ((r - 1, c - 1), (1, 1)), ((2, 0), (0, c))]


def check_all(ck, sd, reader_=None, row_pad=0):
    for name, full in sd.items():
        for offs, shape in blocks(full):
            t = target(name, full, offs, shape, row_pad=row_pad)
            stats = load_targets([t], ck)
            assert same_bits(t.tensor, expect(full, offs, shape)), (name, offs, shape)
            assert stats.loaded == 1 and not stats.missing


# ---------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["torch_save", "safetensors"])
def test_dcp_single_process(tmp_path, reader, fmt):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    sd = state()
    w = FileSystemWriter(str(tmp_path), serialization_format=SerializationFormat(fmt))
    # non-tensor entries are written as byte items ahead of the tensors in the same file
    dcp.save({**sd, "step": 7, "meta": {"lr": [0.1]}}, storage_writer=w)
    ck = open_checkpoint(tmp_path)
    assert ck.format == ("dcp" if fmt == "torch_save" else "dcp-safetensors")
    assert set(ck.tensors()) == set(sd)
    check_all(ck, sd)
    check_all(ck, sd, row_pad=3)


def test_safetensors_file_and_index(tmp_path, reader):
    sd = state(1)
    save_file(sd, str(tmp_path / "one.safetensors"))
    check_all(open_checkpoint(tmp_path / "one.safetensors"), sd)
    d = tmp_path / "shards"
    d.mkdir()
    save_file({k: sd[k] for k in ("emb", "vec")}, str(d / "a.safetensors"))
    save_file({k: sd[k] for k in ("ids", "half")}, str(d / "b.safetensors"))
    import json
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "emb": "a.safetensors", "vec": "a.safetensors", "ids": "b.safetensors",
        "half": "b.safetensors"}}))
    check_all(open_checkpoint(d), sd)


def test_torch_save_state_dict_and_views(tmp_path, reader):
    sd = state(2)
    base = torch.randn(40, 20)
    sd["view"] = base[3:30, 4:15]  # saved as a strided view of a larger storage
    torch.save(sd, tmp_path / "sd.pt")
    ck = open_checkpoint(tmp_path / "sd.pt")
    assert ck.tensors()["view"].chunks[0].strides == (20, 1)
    check_all(ck, sd)


@pytest.mark.parametrize("dst", [torch.float16, torch.bfloat16])
def test_fp32_into_half_targets_matches_torch_to(tmp_path, reader, dst):
    full = torch.randn(300, 33) * torch.logspace(-8, 6, 33)  # spans subnormals to overflow
    full[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 65520.0, 1e-8])
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    ck = open_checkpoint(tmp_path / "w.safetensors")
    for offs, shape in [((0, 0), (300, 33)), ((7, 3), (200, 20))]:
        t = target("w", full, offs, shape, dtype=dst)
        load_targets([t], ck, io_threads=2)
        assert same_bits(t.tensor, expect(full, offs, shape).to(dst))
    with pytest.raises(DtypeMismatchError, match="exact"):
        load_targets([target("w", full, (0, 0), (1, 1), dtype=dst)], ck, dtype="exact")


def test_half_into_fp32_and_between_halves(tmp_path, reader):
    h = torch.randn(64, 9).half()
    b = torch.randn(64, 9).bfloat16()
    save_file({"h": h, "b": b}, str(tmp_path / "x.safetensors"))
    ck = open_checkpoint(tmp_path / "x.safetensors")
    for name, full in (("h", h), ("b", b)):
        for dst in (torch.float32, torch.float16, torch.bfloat16):
            t = target(name, full, (1, 2), (60, 6), dtype=dst)
            load_targets([t], ck)
            assert same_bits(t.tensor, expect(full, (1, 2), (60, 6)).float().to(dst))


def test_int_to_float_is_refused(tmp_path, reader):
    sd = state()
    save_file(sd, str(tmp_path / "s.safetensors"))
    ck = open_checkpoint(tmp_path / "s.safetensors")
    t = target("ids", sd["ids"], (0, 0), (9, 3), dtype=torch.float32)
    with pytest.raises(DtypeMismatchError, match="'ids'"):
        load_targets([t], ck)


# ---------------------------------------------------------------------- missing / strictness


def test_strict_and_non_strict_missing(tmp_path, reader):
    sd = state()
    save_file(sd, str(tmp_path / "s.safetensors"))
    ck = open_checkpoint(tmp_path / "s.safetensors")
    ghost = target("ghost.weight", torch.zeros(4, 4), (0, 0), (4, 4))
    good = target("emb", sd["emb"], (0, 0), (37, 11))
    with pytest.raises(MissingTensorError, match="ghost.weight") as ei:
        load_targets([good, ghost], ck)
    assert ei.value.names == ["ghost.weight"]
    assert torch.isnan(good.tensor).all()  # nothing written
    stats = load_targets([good, ghost], ck, strict=False)
    assert stats.missing == [ghost] and stats.loaded == 1
    assert torch.equal(good.tensor, sd["emb"])
    assert torch.isnan(ghost.tensor).all()


# ------------------------------------------------------------------ corrupt / mismatched input


def _poisoned_targets(sd):
    return [target(k, v, (0,) * v.dim(), tuple(v.shape)) for k, v in sd.items()]


def _untouched(ts):
    for t in ts:
        x = t.tensor
        if x.dtype.is_floating_point:
            assert torch.isnan(x).all(), t.fqn
        else:
            assert (x == -7).all(), t.fqn


def test_file_truncated_after_open(tmp_path, reader):
    sd = state()
    save_file(sd, str(tmp_path / "s.safetensors"))
    ck = open_checkpoint(tmp_path / "s.safetensors")
    os.truncate(tmp_path / "s.safetensors", os.path.getsize(tmp_path / "s.safetensors") - 10)
    ts = _poisoned_targets(sd)
    with pytest.raises(TruncatedFileError, match="s.safetensors"):
        load_targets(ts, ck)
    _untouched(ts)


def test_dcp_chunk_truncated(tmp_path, reader):
    sd = state()
    dcp.save(sd, checkpoint_id=str(tmp_path))
    (f,) = [p for p in os.listdir(tmp_path) if p.endswith(".distcp")]
    os.truncate(tmp_path / f, os.path.getsize(tmp_path / f) - 700)
    with pytest.raises(CheckpointError, match=f):
        open_checkpoint(tmp_path)


def test_offsets_outside_file_and_wrong_shape_dtype(tmp_path, reader):
    sd = state()
    ts = _poisoned_targets(sd)
    p = str(tmp_path / "s.safetensors")
    save_file(sd, p)
    size = os.path.getsize(p)
    # a hand-built index pointing past the end of the file
    e = TensorEntry("emb", (37, 11), torch.float32,
                    [Chunk(p, size - 100, 37 * 11 * 4, (0, 0), (37, 11))])
    with pytest.raises(TruncatedFileError, match="'emb'"):
        Checkpoint("safetensors", p, {"emb": e})
    ck = open_checkpoint(p)
    with pytest.raises(ShapeMismatchError, match="'emb'"):
        load_targets([target("emb", torch.zeros(37, 12), (0, 0), (37, 12))] + ts, ck)
    with pytest.raises(DtypeMismatchError, match="'ids'"):
        load_targets(ts[:1] + [target("ids", sd["ids"], (0, 0), (9, 3), torch.int32)], ck)
    bad_dst = target("emb", sd["emb"], (0, 0), (37, 11))
    bad_dst.tensor = bad_dst.tensor.t().contiguous().t()
    with pytest.raises(DestinationError, match="inner stride"):
        load_targets(ts + [bad_dst], ck)
    _untouched(ts)


def test_corrupt_header_raises_named_error(tmp_path, reader):
    sd = state()
    p = tmp_path / "s.safetensors"
    save_file(sd, str(p))
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", len(raw) * 2)
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="past the end"):
        open_checkpoint(p)


def test_coverage_gap_detected(tmp_path):
    p = str(tmp_path / "f.bin")
    with open(p, "wb") as f:
        f.write(b"\0" * 4096)
    e = TensorEntry("w", (10, 4), torch.float32, [
        Chunk(p, 0, 4 * 4 * 4, (0, 0), (4, 4)), Chunk(p, 64, 5 * 4 * 4, (5, 0), (5, 4))])
    ck = Checkpoint("safetensors", p, {"w": e})
    t = Target("w", "w", (10, 4), (2, 0), (6, 4), torch.float32, tensor=torch.empty(6, 4))
    with pytest.raises(CoverageError, match="'w'"):
        plan_load([t], ck)
    e.chunks.append(Chunk(p, 0, 2 * 4 * 4, (3, 0), (2, 4)))  # overlaps row 3
    from metamat.checkpoint import OverlappingChunksError
    with pytest.raises(OverlappingChunksError):
        plan_load([t], ck)


# ------------------------------------------------------------------------------- planning


def _synthetic(path, global_shape, row_cuts, col_cuts, dtype=torch.float32):
    """A chunked checkpoint index over one file laid out chunk after chunk, plus the tensor."""
    full = torch.arange(global_shape[0] * global_shape[1], dtype=torch.float32).reshape(
        global_shape).to(dtype)
    chunks, blobs, off = [], [], 13  # odd start: unaligned like DCP
    rs = [0] + list(row_cuts) + [global_shape[0]]
    cs = [0] + list(col_cuts) + [global_shape[1]]
    for r0, r1 in zip(rs, rs[1:]):
        for c0, c1 in zip(cs, cs[1:]):
            if r1 <= r0 or c1 <= c0:
                continue
            b = full[r0:r1, c0:c1].contiguous().view(torch.uint8).numpy().tobytes()
            chunks.append(Chunk(path, off, len(b), (r0, c0), (r1 - r0, c1 - c0)))
            blobs.append(b)
            off += len(b) + 3
    with open(path, "wb") as f:
        f.write(b"\x55" * 13)
        for b in blobs:
            f.write(b + b"\xaa" * 3)
    return Checkpoint("dcp", path, {"w": TensorEntry("w", tuple(global_shape), dtype, chunks)}), full


def test_plan_row_blocks_read_exactly_what_they_need(tmp_path):
    ck, full = _synthetic(str(tmp_path / "rw.bin"), (1000, 64), [250, 500, 750], [])
    t = Target("w", "w", (1000, 64), (100, 0), (600, 64), torch.float32,
               tensor=torch.empty(600, 64))
    plan = plan_load([t], ck)
    assert [o.rows for o in plan.ops] == [1, 1, 1]  # contiguous runs, one per chunk
    assert sum(o.src_bytes for o in plan.ops) == plan.bytes_needed == 600 * 64 * 4


def test_plan_column_slices_are_strided_ops(tmp_path):
    ck, full = _synthetic(str(tmp_path / "cw.bin"), (100, 64), [], [16, 32, 48])
    # a whole CW shard: contiguous
    t = Target("w", "w", (100, 64), (0, 16), (100, 16), torch.float32,
               tensor=torch.empty(100, 16))
    (op,) = plan_load([t], ck).ops
    assert op.rows == 1 and op.row_bytes == 100 * 16 * 4
    # a column slice straddling two chunks: two strided ops
    t = Target("w", "w", (100, 64), (10, 20), (50, 20), torch.float32,
               tensor=torch.empty(50, 20))
    ops = plan_load([t], ck).ops
    assert [(o.rows, o.row_bytes, o.src_stride, o.dst_stride) for o in ops] == [
        (50, 12 * 4, 16 * 4, 20 * 4), (50, 8 * 4, 16 * 4, 20 * 4)]


def test_plan_merges_adjacent_runs(tmp_path):
    p = str(tmp_path / "m.bin")
    with open(p, "wb") as f:
        f.write(b"\0" * 4000)
    # two row chunks stored back to back: one read
    e = TensorEntry("w", (10, 4), torch.float32, [
        Chunk(p, 100, 5 * 16, (0, 0), (5, 4)), Chunk(p, 180, 5 * 16, (5, 0), (5, 4))])
    ck = Checkpoint("safetensors", p, {"w": e})
    t = Target("w", "w", (10, 4), (0, 0), (10, 4), torch.float32, tensor=torch.empty(10, 4))
    (op,) = plan_load([t], ck).ops
    assert (op.file_offset, op.row_bytes) == (100, 160)


def test_plan_without_tensors_allocates_nothing(tmp_path):
    ck, _ = _synthetic(str(tmp_path / "p.bin"), (50, 8), [20], [4])
    t = Target("w", "w", (50, 8), (10, 2), (30, 5), torch.float16)
    plan = plan_load([t], ck, check_destinations=False)
    assert plan.bytes_needed == 30 * 5 * 4 and len(plan.ops) == 4


def test_row_block_amplification_on_real_dcp(tmp_path, reader):
    sd = {"w": torch.randn(4000, 32)}
    dcp.save(sd, checkpoint_id=str(tmp_path))
    ck = open_checkpoint(tmp_path)
    t = target("w", sd["w"], (1000, 0), (1500, 32))
    stats = load_targets([t], ck)
    assert stats.read_amplification <= 1.05
    assert stats.bytes_read == stats.bytes_needed == 1500 * 32 * 4


def test_progress_and_threads(tmp_path, reader):
    ck, full = _synthetic(str(tmp_path / "big.bin"), (3001, 257), [999, 1000, 2000], [100])
    seen = []
    t = target("w", full, (1, 3), (2999, 250))
    load_targets([t], ck, io_threads=3, progress=lambda d, n: seen.append((d, n)))
    assert same_bits(t.tensor, expect(full, (1, 3), (2999, 250)))
    assert seen and seen[-1][0] == seen[-1][1]


# ------------------------------------------------------------------------------- property


@st.composite
def chunking_and_block(draw):
    R = draw(st.integers(1, 40))
    C = draw(st.integers(1, 24))
    rc = sorted(set(draw(st.lists(st.integers(1, max(1, R - 1)), max_size=4)))) if R > 1 else []
    cc = sorted(set(draw(st.lists(st.integers(1, max(1, C - 1)), max_size=4)))) if C > 1 else []
    r0 = draw(st.integers(0, R - 1))
    c0 = draw(st.integers(0, C - 1))
    nr = draw(st.integers(1, R - r0))
    nc = draw(st.integers(1, C - c0))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    pad = draw(st.integers(0, 2))
    threads = draw(st.integers(1, 3))
    gap = draw(st.sampled_from([-1, 0, 4096]))
    return (R, C), rc, cc, (r0, c0), (nr, nc), dtype, pad, threads, gap


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=chunking_and_block())
def test_any_chunking_any_block_same_slice(tmp_path_factory, reader, case):
    from metamat.budget import StagingBudget
    from metamat.load.execute import execute_plan
    shape, rc, cc, offs, bshape, dtype, pad, threads, gap = case
    d = tmp_path_factory.mktemp("prop")
    ck, full = _synthetic(str(d / "c.bin"), shape, rc, cc)
    t = target("w", full, offs, bshape, dtype=dtype, row_pad=pad)
    plan = plan_load([t], ck)
    execute_plan(plan, StagingBudget.split(256 << 20, threads, staged=False), coalesce_gap=gap)
    assert same_bits(t.tensor, expect(full, offs, bshape).to(dtype))
