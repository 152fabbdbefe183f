"""The C++ CPU engine equals the NumPy reference bit for bit, at boundary sizes."""
import pytest
import torch

import metamat
from metamat.reference import reference_block
from conftest import bits

DISTS = [
    metamat.Uniform(-0.25, 0.75),
    metamat.Normal(0.5, 2.0),
    metamat.TruncatedNormal(0.0, 1.0, -1.5, 2.0),
    metamat.Constant(3.25),
    metamat.Zeros(),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Straddle the 8-column word run, the 32-column Philox block and the 64-column CPU pass.
COLS = [1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 129]
OFFSETS = [0, 1, 7, 8, 31, 32, 33, 63, 64, 65]


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: type(d).__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_at_boundaries(dist, dtype):
    for cols in COLS:
        for col_offset in OFFSETS:
            row_offset = (cols * 7 + col_offset) % 5
            t = poisoned((3, cols), dtype)
            metamat.fill_(t, dist, seed=11, key="table", row_offset=row_offset, col_offset=col_offset)
            ref = reference_block((3, cols), dist, seed=11, key="table", row_offset=row_offset,
                                  col_offset=col_offset, dtype=dtype)
            assert torch.equal(bits(t), bits(ref)), (cols, col_offset)


def test_strided_rows_untouched_padding():
    base = poisoned((6, 100), torch.float32)
    view = base[1:5, 10:77]  # row stride 100, unit column stride
    metamat.fill_(view, metamat.Uniform(-1, 1), key="t", row_offset=5, col_offset=40)
    ref = reference_block((4, 67), metamat.Uniform(-1, 1), key="t", row_offset=5, col_offset=40)
    assert torch.equal(view, ref)
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[1:5, 10:77] = False
    assert torch.isnan(base[outside]).all()


def test_one_dim_is_one_row():
    t = poisoned((70,), torch.float32)
    metamat.fill_(t, metamat.Normal(), key="bias", row_offset=33)
    full = poisoned((200,), torch.float32)
    metamat.fill_(full, metamat.Normal(), key="bias")
    assert torch.equal(t, full[33:103])
    u = poisoned((70,), torch.float32)
    metamat.fill_(u, metamat.Normal(), key="bias", col_offset=33)
    assert torch.equal(u, t)


def test_large_threaded_fill_matches_reference_and_threads_agree():
    shape = (1537, 129)  # > 256 Ki elements: the engine uses several threads
    ref = reference_block(shape, metamat.Normal(), seed=3, key="big", row_offset=9, col_offset=3)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            t = poisoned(shape, torch.float32)
            metamat.fill_(t, metamat.Normal(), seed=3, key="big", row_offset=9, col_offset=3)
            assert torch.equal(t, ref), threads
    finally:
        torch.set_num_threads(old)


def test_fill_many_equals_separate_fills():
    shapes = [(5, 3), (40, 64), (1, 200), (17, 33)]
    dists = [metamat.Uniform(0, 1), metamat.Normal(), metamat.Constant(2.0),
             metamat.TruncatedNormal()]
    many = [poisoned(s, torch.float32) for s in shapes]
    metamat.fill_many_([(t, d, f"t{i}", i, 2 * i) for i, (t, d) in enumerate(zip(many, dists))],
                       seed=5)
    for i, (s, d) in enumerate(zip(shapes, dists)):
        one = poisoned(s, torch.float32)
        metamat.fill_(one, d, seed=5, key=f"t{i}", row_offset=i, col_offset=2 * i)
        assert torch.equal(one, many[i])


def test_seed_and_key_change_values_deterministically():
    a = metamat.fill_(torch.empty(64, 64), metamat.Uniform(), seed=1, key="x")
    b = metamat.fill_(torch.empty(64, 64), metamat.Uniform(), seed=1, key="x")
    c = metamat.fill_(torch.empty(64, 64), metamat.Uniform(), seed=2, key="x")
    d = metamat.fill_(torch.empty(64, 64), metamat.Uniform(), seed=1, key="y")
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_empty_tensors_are_fine():
    metamat.fill_many_([(torch.empty(0, 5), metamat.Normal(), "e", 0, 0),
                        (torch.empty(3, 0), metamat.Normal(), "e", 0, 0)])


@pytest.mark.parametrize("isa", ["avx512", "avx2", "x86-64"])
@pytest.mark.parametrize("dist", DISTS[:4], ids=lambda d: type(d).__name__)
def test_every_cpu_kernel_matches_reference(isa, dist):
    """Each instruction-set build of the CPU kernel (forced) equals the reference, on blocks
    whose ends straddle the 8-column word runs, the 32-column blocks and the 64-column passes."""
    from metamat._ext import core
    from metamat.init import _pack

    if isa not in core().cpu_kernels():
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    # The last case crosses column counter 2^32 (column 2^34) and row 2^32 (high words).
    for cols, col_offset, row_offset in [(1, 0, 77), (5, 59, 77), (63, 1, 77), (64, 0, 77),
                                         (64, 32, 77), (65, 63, 77), (129, 64, 77),
                                         (197, 45, 77), (140, 2**34 - 70, 2**32 - 2)]:
        for dtype in DTYPES:
            t = poisoned((5, cols + 6), dtype)
            segs = _pack([(t[:, 3:3 + cols], dist, "isa", row_offset, col_offset)], 2)
            core().fill_cpu(segs.ctypes.data, len(segs), 2, isa)
            ref = reference_block((5, cols), dist, seed=2, key="isa", row_offset=row_offset,
                                  col_offset=col_offset, dtype=dtype)
            assert torch.equal(bits(t[:, 3:3 + cols]), bits(ref)), (cols, col_offset, dtype)
            assert torch.isnan(t[:, :3].float()).all()
            assert torch.isnan(t[:, 3 + cols:].float()).all()


def test_unknown_kernel_name_is_an_error():
    from metamat._ext import core
    from metamat.init import _pack

    segs = _pack([(torch.zeros(2, 2), metamat.Uniform(), "k", 0, 0)], 0)
    with pytest.raises(RuntimeError, match="unknown CPU kernel"):
        core().fill_cpu(segs.ctypes.data, 1, 1, "sse9")
