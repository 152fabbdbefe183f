"""io='auto' in the C++ reader: large reads of pages that are mostly not in the page cache
("cold") are read buffered with sequential readahead and then dropped from the page cache, so
a cold load leaves the cache as it found it (what O_DIRECT did, faster on this project's
virtio disk: see io_reader.h); cached or small reads are plain buffered and stay cached;
io='buffered' never drops pages. Every combination gives the same bytes."""
from __future__ import annotations

import pytest

from metamat._pagecache import evict, resident
from reader_ops import POISON, addr, ops, poisoned, random_file

SIZE = 24 * (1 << 20) + 4321


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return random_file(tmp_path_factory, "auto", SIZE, 5)


def _read_all(reader, path, io, off=0, n=SIZE, **kw):
    raw = poisoned(n + 2)
    arr = ops((0, off, n, 1, 0, 0, addr(raw, 1), 0, 0))
    r = reader.read_plan([path], arr.ctypes.data, 1, io=io, **kw)
    assert r["ok"], r["error"]
    assert raw[0] == POISON and raw[-1] == POISON
    return r, bytes(raw[1:1 + n])


def _cold(path):
    if evict(path).after > 0.05:
        pytest.skip("posix_fadvise(DONTNEED) did not evict the pages here")


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_cold_auto_reads_buffered_and_leaves_the_cache_cold(reader, data_file, threads):
    path, body = data_file
    _cold(path)
    r, got = _read_all(reader, path, "auto", threads=threads, task_bytes=1 << 20)
    assert got == body
    f = r["files"][0]
    assert f["mode"] == "buffered" and f["bytes_direct"] == 0 and not f["direct_refused"], f
    # only the pages two tasks share (and readahead past the last one) may stay
    assert resident(path) < 0.1, resident(path)


def test_warm_auto_keeps_the_cache(reader, data_file):
    path, body = data_file
    with open(path, "rb") as fh:
        fh.read()
    assert resident(path) > 0.9
    r, got = _read_all(reader, path, "auto", threads=2, task_bytes=1 << 20)
    assert got == body and r["files"][0]["mode"] == "buffered"
    assert resident(path) > 0.9


def test_cold_buffered_fills_the_cache(reader, data_file):
    path, body = data_file
    _cold(path)
    r, got = _read_all(reader, path, "buffered", threads=2, task_bytes=1 << 20)
    assert got == body and r["files"][0]["mode"] == "buffered"
    assert resident(path) > 0.9


def test_small_cold_reads_are_not_dropped(reader, data_file):
    """Below auto_direct_min (1 MiB) a read is never "cold": read and kept like buffered."""
    path, body = data_file
    _cold(path)
    off, n = (1 << 20) + 5, 300_000
    r, got = _read_all(reader, path, "auto", off=off, n=n, threads=1)
    assert got == body[off:off + n]
    assert resident(path) > 0.0


@pytest.mark.parametrize("env", [{}, {"METAMAT_IO_READAHEAD": "0"}, {"METAMAT_PREFAULT": "0"},
                                 {"METAMAT_IO_AUTO": "direct"},
                                 {"METAMAT_IO_AUTO": "direct", "METAMAT_IO_OVERLAP": "0"}])
@pytest.mark.parametrize("io", ["auto", "buffered", "direct"])
def test_switches_give_the_same_bytes(reader, data_file, monkeypatch, env, io):
    path, body = data_file
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _cold(path)
    off = 4097
    r, got = _read_all(reader, path, io, off=off, n=SIZE - off - 3, threads=2,
                       task_bytes=3 << 20)
    assert got == body[off:SIZE - 3]
    f = r["files"][0]
    direct = io == "direct" or (io == "auto" and env.get("METAMAT_IO_AUTO") == "direct")
    assert (f["bytes_direct"] > 0) == direct, (f, env)
