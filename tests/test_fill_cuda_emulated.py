"""The CUDA launch run on the host (``_C.fill_cuda_emulated``: the kernel's segment table,
block search, per-thread units and vector/scalar store decisions, fill_units.h and
fill_unit_work.h) writes exactly what the CPU engine writes, bit for bit, and takes the
vector path where the layout allows it."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import metamat
from metamat._ext import core
from metamat.init import _pack
from conftest import bits

DISTS = [metamat.Uniform(-1, 1), metamat.Normal(0, 2), metamat.TruncatedNormal(), metamat.Constant(7)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def emulate(items, seed=0, force_wide=False):
    segs = _pack(items, seed)
    return core().fill_cuda_emulated(segs.ctypes.data, len(segs), force_wide)


def make_block(rows, cols, pad, dtype, shift):
    """A NaN-poisoned rows x cols view with row stride cols + pad whose data pointer is
    `shift` elements past an aligned allocation; returns (whole buffer, view)."""
    buf = torch.full((shift + rows * (cols + pad) + 1,), float("nan"), dtype=dtype)
    view = buf[shift:shift + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]
    return buf, view


def run_both(specs, seed, force_wide=False):
    """specs: (rows, cols, pad, dtype_i, dist_i, r0, c0[, shift]) -> (emulated, cpu, stats)."""
    out = []
    for _ in range(2):
        bufs, items = [], []
        for i, spec in enumerate(specs):
            rows, cols, pad, di, ki, r0, c0 = spec[:7]
            buf, view = make_block(rows, cols, pad, DTYPES[di], spec[7] if len(spec) > 7 else 0)
            bufs.append(buf)
            items.append((view, DISTS[ki], f"t{i % 7}", r0, c0))
        out.append((bufs, items))
    stats = emulate(out[0][1], seed, force_wide)
    metamat.fill_many_(out[1][1], seed=seed)
    return out[0][0], out[1][0], stats


def assert_same(emulated, cpu):
    for i, (a, b) in enumerate(zip(emulated, cpu)):
        assert torch.equal(bits(a), bits(b)), f"block {i}"


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 100), st.integers(0, 5),
                                st.integers(0, 3), st.integers(0, 3), st.integers(0, 10**6),
                                st.integers(0, 300), st.integers(0, 3)), min_size=1, max_size=12),
       seed=st.integers(0, 2**32), force_wide=st.booleans())
def test_emulated_launch_equals_cpu(specs, seed, force_wide):
    emulated, cpu, _ = run_both(specs, seed, force_wide)
    assert_same(emulated, cpu)


@pytest.mark.parametrize("dtype_i", range(4), ids=lambda i: str(DTYPES[i]))
@pytest.mark.parametrize("dist_i", range(4), ids=lambda i: type(DISTS[i]).__name__)
def test_narrow_and_unaligned_tables(dtype_i, dist_i):
    # D = 1..40 at column offsets that are and are not multiples of 4, 8 and 32; row strides
    # that are not multiples of 4; data pointers one element past alignment.
    specs = []
    for d in range(1, 41):
        for c0, pad, shift in [(0, 0, 0), (3, 1, 1), (8, 3, 0), (29, 0, 1), (32, 2, 0)]:
            specs.append((5, d, pad, dtype_i, dist_i, 17 * d, c0 + 64 * d, shift))
    emulated, cpu, stats = run_both(specs, 3)
    assert_same(emulated, cpu)
    assert stats["vector_stores"] > 0 and stats["scalar_stores"] > 0


@pytest.mark.parametrize("dtype_i", range(4), ids=lambda i: str(DTYPES[i]))
def test_aligned_table_takes_only_full_vectors(dtype_i):
    # 32-column multiples at an aligned pointer and stride: every unit is interior, every
    # store a 16-byte vector, every Philox call used.
    rows, cols = 9, 96
    emulated, cpu, stats = run_both([(rows, cols, 32, dtype_i, 0, 5, 64)], 1)
    assert_same(emulated, cpu)
    nbytes = rows * cols * DTYPES[dtype_i].itemsize
    assert stats["scalar_stores"] == 0
    assert stats["vector_bytes"] == nbytes and stats["vector_stores"] == nbytes // 16
    assert stats["philox_calls"] == rows * cols // 4


@pytest.mark.parametrize("cols,calls_per_row", [(1, 4), (4, 4), (5, 8), (8, 8), (16, 8), (31, 8),
                                                (33, 12)])
def test_narrow_rows_compute_only_their_counters(cols, calls_per_row):
    # D < 32 does not pay for 32 columns: a row computes the Philox counters of the lanes
    # (in halves of 4) that hold its columns; words outside the row are not transformed.
    rows = 7
    emulated, cpu, stats = run_both([(rows, cols, 0, 0, 1, 3, 0)], 2)
    assert_same(emulated, cpu)
    assert stats["philox_calls"] == rows * calls_per_row


def test_unaligned_pointer_falls_back_to_scalar_stores():
    emulated, cpu, stats = run_both([(4, 64, 0, 0, 0, 0, 0, 1)], 5)  # fp32, pointer + 4 bytes
    assert_same(emulated, cpu)
    assert stats["vector_stores"] == 0 and stats["scalar_stores"] == 4 * 64


def test_many_small_tables_with_empty_ones_between():
    # 3000 tables of 3 x 17 with odd offsets, empty tables between them: 2 rounds of the
    # block search, one tile per table.
    specs = [(3 if i % 11 else 0, 17, 1, i % 4, i % 4, i, (5 * i) % 64) for i in range(3000)]
    emulated, cpu, stats = run_both(specs, 9)
    assert_same(emulated, cpu)
    nonempty = sum(1 for s in specs if s[0])
    assert stats["segments"] == nonempty and stats["tiles"] == nonempty


def test_thousands_of_segments_spanning_several_tiles():
    specs = [(40 + i % 3, 33 * (i % 5) + 1, i % 2, i % 4, (i // 4) % 4, 7 * i, 3 * i, i % 2)
             if i % 5 else (0, 9, 0, 0, 0, 0, 0) for i in range(1200)]
    emulated, cpu, _ = run_both(specs, 4)
    assert_same(emulated, cpu)


@pytest.mark.parametrize("force_wide", [False, True])
def test_64_bit_offsets(force_wide):
    # Global rows near 2**40 and past 2**32, columns past 2**31: counters and rows use their
    # high words; a table of > 2**31 elements is addressed through its row offset.
    specs = [(700, 333, 3, 0, 1, 2**33 + 5, 2**20 + 3), (5, 40, 0, 2, 0, 2**40 - 2, 2**31 + 7, 1),
             (3, 100, 0, 1, 2, 2**40 + 2**35, 17), (2, 64, 0, 3, 1, 2**62, 2**40 + 32)]
    emulated, cpu, _ = run_both(specs, 1, force_wide)
    assert_same(emulated, cpu)


def test_wide_rows_use_many_blocks_per_row():
    # blocks_per_row far from a power of two exercises the 32-bit unit -> row division
    for cols, c0 in [(100_000, 0), (99_937, 13), (4096, 31)]:
        emulated, cpu, _ = run_both([(3, cols, 0, 0, 0, 11, c0)], 6)
        assert_same(emulated, cpu)


def test_bad_segment_is_rejected_before_writing():
    t = torch.full((4, 4), float("nan"))
    segs = _pack([(t, metamat.Uniform(), "k", 0, 0)], 0)
    segs["dtype"] = 99
    with pytest.raises(RuntimeError, match="unknown dtype code"):
        core().fill_cuda_emulated(segs.ctypes.data, len(segs), False)
    assert torch.isnan(t).all()
