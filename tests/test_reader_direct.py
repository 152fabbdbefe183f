"""Direct I/O in the C++ reader: every op shape (contiguous, strided, coalesced, converting,
aligned or not, up to the end of the file) gives the same bytes with io='buffered', 'direct'
and 'auto'; O_DIRECT refusals fall back to buffered reads per file and are reported; faults
keep working in direct mode. Files live in /tmp (ext4 here: O_DIRECT works) and /dev/shm."""
from __future__ import annotations

import os

import numpy as np
import pytest

from metamat._pagecache import evict, resident
from reader_ops import BF16, F16, F32, POISON, addr, expected_rows, ops, poisoned

MODES = ("buffered", "direct", "auto")
SIZE = 3 * (1 << 20) + 1234  # not a multiple of any alignment


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    rng = np.random.default_rng(7)
    # finite floats so conversions are comparable; raw bytes are random anyway
    body = rng.standard_normal(SIZE // 4, dtype=np.float32).tobytes() + b"\x01\x02"
    body = body + rng.integers(0, 256, SIZE - len(body), dtype=np.uint8).tobytes()
    p = tmp_path_factory.mktemp("direct") / "data.bin"
    p.write_bytes(body)
    return str(p), body


def _aligned(nbytes: int, align: int = 4096, shift: int = 0) -> tuple:
    """A poisoned buffer whose data starts `shift` bytes past an `align` boundary."""
    raw = poisoned(nbytes + 2 * align)
    off = (-raw.ctypes.data) % align + shift
    return raw, off


def _shapes(body: bytes):
    """(name, op tuple builder, expected bytes) for every op shape."""
    f32 = np.frombuffer(body[: (len(body) // 4) * 4], dtype=np.float32)
    out = []
    # contiguous raw, unaligned offset, large
    out.append(("contig_unaligned", 12345, 2 << 20, 1, 0, 0, 0, body[12345: 12345 + (2 << 20)]))
    # contiguous raw at an aligned offset (dst lined up below)
    out.append(("contig_aligned", 8192, 1 << 20, 1, 0, 0, 0, body[8192: 8192 + (1 << 20)]))
    # tail of the file: ends at EOF, not aligned
    out.append(("tail", SIZE - 70001, 70001, 1, 0, 0, 0, body[SIZE - 70001:]))
    # tiny read at an odd offset
    out.append(("tiny", 4097, 3, 1, 0, 0, 0, body[4097:4100]))
    # strided with a big gap (rows read one by one)
    out.append(("strided_sparse", 100, 64, 40, 40000, 64, 0,
                expected_rows(body, 100, 64, 40, 40000)))
    # strided with a small gap (coalesced)
    out.append(("strided_coalesced", 3, 256, 2000, 1024, 256, 0,
                expected_rows(body, 3, 256, 2000, 1024)))
    # contiguous fp32 -> bf16
    n = 300000
    out.append(("convert_bf16", 4 * 1000, 4 * n, 1, 0, 0, (F32, BF16),
                _bf16(f32[1000: 1000 + n])))
    # strided fp32 -> fp16 (columns 5..20 of a 64-wide table)
    rows = f32[: 64 * 5000].reshape(5000, 64)[:, 5:21]
    out.append(("convert_strided_f16", 20, 64, 5000, 256, 32, (F32, F16),
                rows.astype(np.float16).tobytes()))
    return out


def _bf16(x: np.ndarray) -> bytes:
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16)
    return r.tobytes()


def _run(reader, path, shape, io, shift=0, **kw):
    name, off, row_bytes, rows, stride, dst_stride, conv, want = shape
    raw, base = _aligned(len(want), shift=shift)
    s, d = conv if conv else (0, 0)
    arr = ops((0, off, row_bytes, rows, stride, dst_stride, addr(raw, base), s, d))
    r = reader.read_plan([path], arr.ctypes.data, 1, io=io, **kw)
    return r, bytes(raw[base: base + len(want)]), raw, base


@pytest.mark.parametrize("io", MODES)
@pytest.mark.parametrize("shift", [0, 1, 512])
@pytest.mark.parametrize("threads,bounce", [(1, 8 << 20), (3, 64 << 10)])
def test_every_shape_same_bytes(reader, data_file, io, shift, threads, bounce):
    path, body = data_file
    for shape in _shapes(body):
        r, got, raw, base = _run(reader, path, shape, io, shift=shift, threads=threads,
                                 bounce_bytes=bounce, task_bytes=1 << 20)
        assert r["ok"], (shape[0], r["error"])
        assert got == shape[-1], (shape[0], io, shift)
        assert (raw[:base] == POISON).all() and (raw[base + len(got):] == POISON).all()
        if io == "direct":
            assert r["files"][0]["mode"] == "direct", (shape[0], r["files"])
            assert r["files"][0]["bytes_direct"] >= shape[2] * shape[3] or shape[2] == 64


def test_direct_reads_straight_into_lined_up_destination(reader, data_file):
    """Destination and file offset lined up: the aligned middle is read with no bounce,
    so the only extra bytes are the rounding at the two ends."""
    path, body = data_file
    shape = _shapes(body)[1]  # contig_aligned: offset 8192, 1 MiB
    r, got, *_ = _run(reader, path, shape, "direct")
    assert r["ok"] and got == shape[-1]
    assert r["files"][0]["bytes_direct"] == 1 << 20


def test_refused_direct_open_falls_back_per_file(reader, data_file, monkeypatch):
    path, body = data_file
    monkeypatch.setenv("METAMAT_IO_FAULT", "1:nodirect")
    for shape in _shapes(body):
        r, got, *_ = _run(reader, path, shape, "direct")
        assert r["ok"] and got == shape[-1], shape[0]
        f = r["files"][0]
        assert f["mode"] == "buffered" and f["direct_refused"], f
        assert "O_DIRECT" in f["refuse_reason"], f


@pytest.mark.parametrize("nth", [1, 2, 5])
def test_einval_on_direct_read_falls_back(reader, data_file, monkeypatch, nth):
    path, body = data_file
    monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:einval")
    shapes = _shapes(body)
    raws = [_aligned(len(s[-1]), shift=1) for s in shapes]
    rows = []
    for s, (raw, base) in zip(shapes, raws):
        c = s[6] if s[6] else (0, 0)
        rows.append((0, s[1], s[2], s[3], s[4], s[5], addr(raw, base), c[0], c[1]))
    arr = ops(*rows)
    r = reader.read_plan([path], arr.ctypes.data, len(arr), io="direct", threads=2,
                         task_bytes=256 << 10)
    assert r["ok"], r["error"]
    for s, (raw, base) in zip(shapes, raws):
        assert bytes(raw[base: base + len(s[-1])]) == s[-1], s[0]
    f = r["files"][0]
    assert f["direct_refused"] and "Invalid argument" in f["refuse_reason"], f
    assert f["bytes_buffered"] > 0


@pytest.mark.parametrize("io", ["direct", "auto"])
@pytest.mark.parametrize("mode,nth", [("eio", 1), ("eio", 4), ("eof", 2)])
def test_errors_in_direct_mode(reader, data_file, monkeypatch, io, mode, nth):
    path, body = data_file
    monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:{mode}")
    shape = _shapes(body)[0]
    evict(path)
    r, *_ = _run(reader, path, shape, io, task_bytes=256 << 10, threads=2)
    assert not r["ok"] and r["wrote"] and path in r["error"], r
    assert ("Input/output error" if mode == "eio" else "unexpected end of file") in r["error"]


@pytest.mark.parametrize("mode", ["short", "eintr"])
@pytest.mark.parametrize("nth", [1, 3])
def test_retried_faults_in_direct_mode(reader, data_file, monkeypatch, mode, nth):
    path, body = data_file
    monkeypatch.setenv("METAMAT_IO_FAULT", f"{nth}:{mode}")
    for shape in _shapes(body):
        r, got, *_ = _run(reader, path, shape, "direct", task_bytes=256 << 10)
        assert r["ok"] and got == shape[-1], (shape[0], r["error"])


def test_auto_reads_cold_direct_when_asked(reader, data_file, monkeypatch):
    """METAMAT_IO_AUTO=direct: io='auto' reads cached ranges buffered, cold ones O_DIRECT."""
    monkeypatch.setenv("METAMAT_IO_AUTO", "direct")
    path, body = data_file
    shape = _shapes(body)[0]
    with open(path, "rb") as f:
        f.read()  # warm
    assert resident(path) > 0.9
    r, got, *_ = _run(reader, path, shape, "auto")
    assert r["ok"] and got == shape[-1]
    assert r["files"][0]["mode"] == "buffered", r["files"]
    if evict(path).after > 0.1:
        pytest.skip("posix_fadvise(DONTNEED) did not evict the pages here")
    r, got, *_ = _run(reader, path, shape, "auto")
    assert r["ok"] and got == shape[-1]
    assert r["files"][0]["bytes_direct"] > 0, r["files"]
    # small reads stay buffered even when cold
    evict(path)
    r, got, *_ = _run(reader, path, _shapes(body)[3], "auto")
    assert r["ok"] and r["files"][0]["mode"] == "buffered"


def test_dev_shm_direct_works_or_falls_back(reader, data_file):
    """tmpfs: older kernels refuse O_DIRECT (EINVAL: fallback), 6.6+ accept it; either way
    the bytes are right and the report says which."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    _, body = data_file
    p = f"/dev/shm/metamat_direct_{os.getpid()}.bin"
    with open(p, "wb") as f:
        f.write(body)
    try:
        for shape in _shapes(body):
            r, got, *_ = _run(reader, p, shape, "direct")
            assert r["ok"] and got == shape[-1], shape[0]
            f = r["files"][0]
            assert f["mode"] == "direct" or (f["direct_refused"] and f["mode"] == "buffered")
    finally:
        os.remove(p)


def test_bad_io_mode(reader, data_file):
    path, _ = data_file
    with pytest.raises(ValueError, match="io must be"):
        reader.read_plan([path], 0, 0, io="mmap")
