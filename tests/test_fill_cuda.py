"""CUDA backend: the same values as the CPU engine, bit for bit, one launch for many tables
(GPU only). The launch-count check needs the profiler (CUPTI): tests/test_fill_cuda_profiler.py,
kept apart so compute-sanitizer runs can leave it out."""
import numpy as np
import pytest
import torch

import metamat
from metamat import init as fill_init
from conftest import bits

pytestmark = pytest.mark.cuda

DISTS = [metamat.Uniform(-1, 1), metamat.Normal(0, 1), metamat.TruncatedNormal(), metamat.Constant(2)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def both(rows, cols, dtype, pad=0, shift=0, device="cuda"):
    """A NaN-poisoned rows x cols view (row stride cols + pad, data pointer `shift` elements
    past the allocation) and its whole buffer."""
    buf = torch.full((shift + rows * (cols + pad) + 1,), float("nan"), dtype=dtype, device=device)
    return buf, buf[shift:shift + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]


def fill_pair(specs, dist, dtype, seed=4):
    """Fill the same blocks on CUDA and CPU in one fill_many_ call each; return the buffers."""
    out = []
    for device in ("cuda", "cpu"):
        bufs, items = [], []
        for i, (rows, cols, pad, shift, r0, c0) in enumerate(specs):
            buf, view = both(rows, cols, dtype, pad, shift, device)
            bufs.append(buf)
            items.append((view, dist, f"t{i % 5}", r0, c0))
        metamat.fill_many_(items, seed=seed)
        out.append(bufs)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: type(d).__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_equals_cpu(dist, dtype):
    specs = [(37, cols, 0, 0, 11, c0) for cols, c0 in [(1, 0), (33, 31), (64, 0), (65, 63), (300, 5),
                                                      (1024, 32), (257, 2**31 + 1)]]
    gpu, cpu = fill_pair(specs, dist, dtype)
    for g, c in zip(gpu, cpu):
        assert torch.equal(bits(g.cpu()), bits(c))


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: type(d).__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_narrow_unaligned_and_64_bit_offsets(dist, dtype):
    # D = 1..40 at offsets that are and are not multiples of 4, 8, 32; odd row strides; data
    # pointers one element past alignment; rows past 2**32 and near 2**40.
    specs = [(6, d, pad, shift, r0 + d, c0 + d)
             for d in range(1, 41)
             for pad, shift, r0, c0 in [(0, 0, 0, 0), (1, 1, 2**33, 3), (3, 0, 2**40 - 9, 29),
                                        (0, 1, 7, 2**31 + 8)]]
    gpu, cpu = fill_pair(specs, dist, dtype)
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        assert torch.equal(bits(g.cpu()), bits(c)), specs[i]


def test_cuda_strided_and_1d():
    base = torch.full((9, 100), float("nan"), device="cuda")
    metamat.fill_(base[2:7, 3:90], metamat.Normal(), key="s", row_offset=2, col_offset=3)
    cpu = torch.full((9, 100), float("nan"))
    metamat.fill_(cpu[2:7, 3:90], metamat.Normal(), key="s", row_offset=2, col_offset=3)
    assert torch.equal(bits(base.cpu()), bits(cpu))
    v = metamat.fill_(torch.empty(1000, device="cuda"), metamat.Uniform(), key="v", col_offset=7)
    assert torch.equal(v.cpu(), metamat.fill_(torch.empty(1000), metamat.Uniform(), key="v", col_offset=7))


def test_ten_thousand_small_tables_with_empty_ones():
    shapes = [(0 if i % 97 == 0 else 1 + i % 9, 1 + (7 * i) % 70) for i in range(10_000)]
    dists = [DISTS[i % 4] for i in range(10_000)]
    tables = {dev: [torch.full(s, float("nan"), device=dev, dtype=DTYPES[i % 4])
                    for i, s in enumerate(shapes)] for dev in ("cuda", "cpu")}
    for dev, ts in tables.items():
        metamat.fill_many_([(t, dists[i], f"t{i}", i, 3 * i) for i, t in enumerate(ts)], seed=8)
    torch.cuda.synchronize()
    for g, c in zip(tables["cuda"], tables["cpu"]):
        assert torch.equal(bits(g.cpu()), bits(c))


def test_fill_runs_on_the_current_stream():
    side = torch.cuda.Stream()
    t = torch.full((512, 256), float("nan"), device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    # the default stream held up (~0.1 s): a fill queued there would land after the mul_
    torch.cuda._sleep(200_000_000)
    with torch.cuda.stream(side):
        metamat.fill_(t, metamat.Normal(), key="s")
        t.mul_(2)  # ordered after the fill only if the fill went to `side`
    torch.cuda.synchronize()
    want = metamat.fill_(torch.empty(512, 256), metamat.Normal(), key="s") * 2
    assert torch.equal(t.cpu(), want)


def test_segment_table_is_pinned_and_kept_until_the_stream_passes():
    fill_init._in_flight.clear()
    t = torch.empty(64, 64, device="cuda")
    metamat.fill_(t, metamat.Uniform(), key="p")
    (event, pinned), = fill_init._in_flight
    assert pinned.is_pinned() and pinned.numel() == fill_init.SEGMENT_DTYPE.itemsize
    event.synchronize()
    metamat.fill_(t, metamat.Uniform(), key="p")  # reaps the finished entry
    assert len(fill_init._in_flight) == 1


def test_pageable_fallback(monkeypatch):
    monkeypatch.setattr(fill_init, "_staging", lambda n: (np.empty(n, np.uint8), None))
    fill_init._in_flight.clear()
    g = torch.full((33, 70), float("nan"), device="cuda", dtype=torch.bfloat16)
    metamat.fill_(g, metamat.TruncatedNormal(), key="f", row_offset=5, col_offset=3)
    c = metamat.fill_(torch.empty(33, 70, dtype=torch.bfloat16), metamat.TruncatedNormal(), key="f",
                      row_offset=5, col_offset=3)
    assert not fill_init._in_flight and torch.equal(bits(g.cpu()), bits(c))
