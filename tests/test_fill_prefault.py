"""Prefaulting fresh destinations (csrc/fill/fill_cpu_prefault.h): never changes a value, never maps
a page outside the bytes the fill writes, and never leaves a thread behind."""
import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

import metamat
from metamat.reference import reference_block

MIB = 1 << 20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def fresh_floats(nbytes):
    """A float32 tensor over a fresh anonymous map (no page mapped yet) and the map itself."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.float32), mm


def resident_pages(t_base, nbytes):
    """Per page of [t_base.data_ptr(), +nbytes): True where mapped (mincore)."""
    vec = (ctypes.c_ubyte * (nbytes // PAGE))()
    rc = _libc.mincore(ctypes.c_void_p(t_base.data_ptr()), ctypes.c_size_t(nbytes), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    return np.frombuffer(vec, dtype=np.uint8) & 1 == 1


def tasks():
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(params=["1", "0"], ids=["prefault", "no-prefault"])
def prefault(request, monkeypatch):
    monkeypatch.setenv("METAMAT_PREFAULT", request.param)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
def test_fresh_fill_values_and_pages_outside_untouched(prefault, threads):
    total = 80 * MIB
    base, mm = fresh_floats(total)
    lo, hi = (8 * MIB + 100) // 4, (72 * MIB - 100) // 4  # not page aligned
    old, before = torch.get_num_threads(), tasks()
    try:
        torch.set_num_threads(threads)
        metamat.fill_(base[lo:hi], metamat.Normal(), seed=4, key="fresh")
    finally:
        torch.set_num_threads(old)
    assert tasks() == before  # the helper thread (if any) was joined
    pages = resident_pages(base, total)
    assert not pages[: 8 * MIB // PAGE].any() and not pages[72 * MIB // PAGE:].any()
    assert pages[8 * MIB // PAGE: 72 * MIB // PAGE].all()
    got = base[lo:hi]
    for at in (0, 1, 12345, (hi - lo) // 2, hi - lo - 1000):  # samples against the reference
        ref = reference_block((1000,), metamat.Normal(), seed=4, key="fresh", col_offset=at)
        assert torch.equal(got[at:at + 1000], ref), at
    whole = torch.empty(hi - lo)
    metamat.fill_(whole, metamat.Normal(), seed=4, key="fresh")  # resident, default threads
    assert torch.equal(got, whole)


def test_strided_gaps_stay_unmapped(prefault):
    """Rows of 4 KiB every 8 KiB: the gap pages are never mapped, prefault or not."""
    rows, total = 8192, 8192 * 8192
    base, mm = fresh_floats(total)
    view = base.view(rows, 2048)[:, :1024]
    before = tasks()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        metamat.fill_(view, metamat.Uniform(-1, 1), seed=1, key="strided")
    finally:
        torch.set_num_threads(old)
    assert tasks() == before
    pages = resident_pages(base, total)
    assert pages[0::2].all() and not pages[1::2].any()
    ref = reference_block((3, 1024), metamat.Uniform(-1, 1), seed=1, key="strided", row_offset=77)
    assert torch.equal(view[77:80], ref)


def test_many_segments_fresh_and_resident_agree(prefault):
    """Several large contiguous segments in one call, 1 thread: same bits as resident fills."""
    base, mm = fresh_floats(48 * MIB)
    parts = [base[: 10 * MIB // 4].view(-1, 128), base[10 * MIB // 4: 40 * MIB // 4].view(-1, 256),
             base[40 * MIB // 4:]]
    items = [(t, metamat.Uniform(-2, 2), f"t{i}", 3 * i, 0) for i, t in enumerate(parts)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        metamat.fill_many_(items, seed=9)
    finally:
        torch.set_num_threads(old)
    for i, t in enumerate(parts):
        again = torch.empty_like(t).fill_(0)
        metamat.fill_(again, metamat.Uniform(-2, 2), seed=9, key=f"t{i}", row_offset=3 * i)
        assert torch.equal(t, again), i
