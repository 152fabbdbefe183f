"""The reader's per-op coalescing rule (issue 10): strided rows are read as spans including
the gaps while that is cheaper than one pread per row (measured: bench/bench_coalesce.py),
coalesce_gap overrides it, and every choice lands the same bytes."""
from __future__ import annotations

import numpy as np
import pytest

from metamat._pagecache import evict
from reader_ops import POISON, addr, expected_rows, ops, poisoned

ROWS = 300


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    body = np.random.default_rng(5).integers(0, 256, ROWS * (16384 + 70000) + 100,
                                             dtype=np.uint8).tobytes()
    p = tmp_path_factory.mktemp("coalesce") / "d.bin"
    p.write_bytes(body)
    return str(p), body


def _read(reader, data, width, gap, **kw):
    path, body = data
    dst = poisoned(width * ROWS)
    arr = ops((0, 3, width, ROWS, width + gap, width, addr(dst), 0, 0))
    r = reader.read_plan([path], arr.ctypes.data, 1, threads=1, task_bytes=1 << 40, **kw)
    assert r["ok"], r["error"]
    assert bytes(dst) == expected_rows(body, 3, width, ROWS, width + gap)
    return r["bytes_read"]


def _span(width, gap):
    return (ROWS - 1) * (width + gap) + width


def _coalesced(n, width):
    """Spans (in bounce-buffer windows) read more than the rows; per-row reads exactly them."""
    return n > width * ROWS


@pytest.mark.parametrize("width,gap,coalesced", [
    (64, 192, True),        # a 16-wide fp32 column shard of a 64-wide table
    (16, 4095, True),       # 4096 - 16/16
    (16, 4096, False),
    (64, 65536, False),
    (1024, 4032, True),     # 4096 - 1024/16
    (1024, 4033, False),
    (4096, 3840, True),
    (4096, 3841, False),
    (16384, 3072, True),
    (16384, 3073, False),   # wide rows: the copy out of the bounce buffer tips it
])
def test_auto_rule(reader, data, width, gap, coalesced):
    n = _read(reader, data, width, gap)
    assert _coalesced(n, width) == coalesced and n <= _span(width, gap)
    if not coalesced:
        assert n == width * ROWS


@pytest.mark.parametrize("gap", [0, 192, 65536])
def test_override(reader, data, gap):
    assert _read(reader, data, 64, gap, coalesce_gap=-1) == 64 * ROWS
    assert _coalesced(_read(reader, data, 64, gap, coalesce_gap=1 << 30), 64) == bool(gap)
    assert _coalesced(_read(reader, data, 64, gap, coalesce_gap=gap), 64) == bool(gap)
    if gap:
        assert _read(reader, data, 64, gap, coalesce_gap=gap - 1) == 64 * ROWS


def test_direct_coalesces_wide_gaps(reader, data):
    """Direct reads pay a device request per row: gaps up to 1 MiB are read through."""
    path, body = data
    dst = poisoned(64 * ROWS)
    arr = ops((0, 3, 64, ROWS, 64 + 65536, 64, addr(dst), 0, 0))
    r = reader.read_plan([path], arr.ctypes.data, 1, threads=1, io="direct")
    assert r["ok"] and bytes(dst) == expected_rows(body, 3, 64, ROWS, 64 + 65536)
    # one aligned request per window of rows, not one 4 KiB request per row
    assert r["files"][0]["bytes_direct"] >= _span(64, 65536) - 2 * (8 << 20)
    r1 = reader.read_plan([path], arr.ctypes.data, 1, threads=1, io="direct", coalesce_gap=-1)
    assert r1["ok"] and r1["files"][0]["bytes_direct"] >= 4096 * ROWS  # a page (or two) per row


def test_read_ops_keeps_its_default(reader, data):
    """read_ops (the current Python executor) still defaults to coalesce_gap=4096."""
    path, body = data
    dst = poisoned(16 * ROWS)
    arr = ops((0, 3, 16, ROWS, 16 + 4096, 16, addr(dst), 0, 0))  # gap 4096: the rule says no
    ok, err, _, nread, _ = reader.read_ops([path], arr.ctypes.data, 1, 1, 1 << 40)
    assert ok and _coalesced(nread, 16)
    ok, err, _, nread, _ = reader.read_ops([path], arr.ctypes.data, 1, 1, 1 << 40, 8 << 20, None)
    assert ok and nread == 16 * ROWS


def test_auto_io_uses_the_rule_of_the_path_it_takes(reader, data, monkeypatch):
    """io='auto' on a cached file reads buffered, so the buffered crossover applies (a 64 KiB
    gap is not read through); evicted, with METAMAT_IO_AUTO=direct it reads direct and
    coalesces wide gaps (without it, cold reads are buffered too: test_reader_auto.py)."""
    monkeypatch.setenv("METAMAT_IO_AUTO", "direct")
    path, body = data
    with open(path, "rb") as f:
        f.read()
    assert _read(reader, data, 64, 65536, io="auto") == 64 * ROWS
    if evict(path).after > 0.1:
        pytest.skip("posix_fadvise(DONTNEED) did not evict the pages here")
    assert _read(reader, data, 64, 65536, io="auto") > 64 * ROWS
