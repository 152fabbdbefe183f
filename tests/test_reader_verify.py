"""Verified reads in the C++ reader (read_plan with verify blocks): each checksum block is
read once by one thread and hashed as its bytes arrive (XXH3-64, digests here from the xxhash
package, as the manifest writer computes them); every op shape lands the same bytes as an
unverified read; a corrupted byte anywhere in a block is reported with the block, expected and
got digests; bad block lists fail before anything is written."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

from reader_ops import BF16, F16, F32, POISON, addr, expected_rows, ops, poisoned

HEAD = 4100                    # chunks start at unaligned offsets
CHUNK_A = (9 << 20) + 12345    # raw bytes: 3 blocks of 4 MiB (the last short)
ROWS, COLS = 3000, 96          # chunk B: a float32 table (row stride 384 bytes)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, CHUNK_A, dtype=np.uint8).tobytes()
    table = rng.standard_normal((ROWS, COLS), dtype=np.float32)
    b = table.tobytes()
    data = b"\x07" * HEAD + a + b"\x00" * 3 + b + b"tail" * 100
    p = tmp_path_factory.mktemp("verify") / "ckpt.bin"
    p.write_bytes(data)
    chunks = [(HEAD, len(a)), (HEAD + len(a) + 3, len(b))]
    return str(p), data, chunks, table


def blocks_for(data, chunks, block_bytes, corrupt=None):
    """(n, 4) int64 blocks: per chunk, block_bytes blocks from the chunk's first byte; digests
    of `data` (before any corruption of the file)."""
    rows = []
    for off, n in chunks:
        for s in range(off, off + n, block_bytes):
            ln = min(block_bytes, off + n - s)
            d = xxhash.xxh3_64_intdigest(data[s:s + ln])
            rows.append((0, s, ln, np.array(d, dtype=np.uint64).view(np.int64)))
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def _op_set(ckpt):
    """Op shapes over both chunks: (op tuple without dst, expected bytes)."""
    path, data, chunks, table = ckpt
    (a0, an), (b0, bn) = chunks
    f32 = table
    out = []
    # a raw run straddling two block boundaries, starting mid-block
    out.append(((0, a0 + 1000, (8 << 20) + 5, 1, 0, 0), 0, 0,
                data[a0 + 1000: a0 + 1000 + (8 << 20) + 5]))
    # the same bytes again into a second destination (ops overlapping each other)
    out.append(((0, a0 + (4 << 20) - 7, 100, 1, 0, 0), 0, 0,
                data[a0 + (4 << 20) - 7: a0 + (4 << 20) + 93]))
    # the tail of chunk A up to its last byte (the short last block)
    out.append(((0, a0 + an - 777, 777, 1, 0, 0), 0, 0, data[a0 + an - 777: a0 + an]))
    # column slice 16..31 of the table (strided, a 16-wide column shard)
    out.append(((0, b0 + 16 * 4, 64, ROWS, COLS * 4, 64), 0, 0,
                expected_rows(data, b0 + 64, 64, ROWS, COLS * 4)))
    # rows 100..2099 of the table converted to bf16 (contiguous, converting)
    x = f32[100:2100].reshape(-1)
    u = x.view(np.uint32).astype(np.uint64)
    bf = ((u + ((u >> 16) & 1) + 0x7FFF) >> 16).astype(np.uint16).tobytes()
    out.append(((0, b0 + 100 * COLS * 4, 2000 * COLS * 4, 1, 0, 0), F32, BF16, bf))
    # columns 40..47 of every row converted to fp16 (strided, converting)
    out.append(((0, b0 + 40 * 4, 32, ROWS, COLS * 4, 16), F32, F16,
                f32[:, 40:48].astype(np.float16).tobytes()))
    return out


def _run(reader, ckpt, blocks, io="buffered", threads=2, op_set=None, **kw):
    path = ckpt[0]
    op_set = op_set if op_set is not None else _op_set(ckpt)
    dsts = [poisoned(len(want)) for *_, want in op_set]
    arr = ops(*[(*o, addr(d), s, t) for (o, s, t, _), d in zip(op_set, dsts)])
    r = reader.read_plan([path], arr.ctypes.data, len(arr), io=io, threads=threads,
                         verify_addr=blocks.ctypes.data if blocks is not None else 0,
                         verify_count=len(blocks) if blocks is not None else -1, **kw)
    return r, dsts, op_set


@pytest.mark.parametrize("io", ["buffered", "direct"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("block_bytes", [4 << 20, 65536, 100003 * 4])
def test_verified_read_same_bytes(reader, ckpt, io, threads, block_bytes):
    _, data, chunks, _ = ckpt
    blocks = blocks_for(data, chunks, block_bytes)
    r, dsts, op_set = _run(reader, ckpt, blocks, io=io, threads=threads)
    assert r["ok"], r["error"]
    assert r["mismatch"] is None
    for (o, *_, want), d in zip(op_set, dsts):
        assert bytes(d) == want, o
    assert r["bytes_hashed"] == sum(c[1] for c in chunks)
    # bytes no op needed: chunk A outside [a0+1000, a0+1000+8M+5) and the last 777, plus the
    # table's bytes outside the column slices and the converted rows... computed below
    need = np.zeros(len(data), dtype=bool)
    for (o, *_), _d in zip(op_set, dsts):
        _, off, rb, rows, stride, _ = o
        for rr in range(rows):
            need[off + rr * stride: off + rr * stride + rb] = True
    covered = np.zeros(len(data), dtype=bool)
    for _, s, ln, _ in blocks:
        covered[s:s + ln] = True
    assert r["bytes_reread"] == int((covered & ~need).sum())
    if io == "direct":
        assert r["files"][0]["bytes_direct"] > 0


@pytest.mark.parametrize("where", ["first", "middle", "last", "last_of_short_block"])
@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_corrupted_byte_is_reported(reader, ckpt, tmp_path, where, io):
    path, data, chunks, _ = ckpt
    blocks = blocks_for(data, chunks, 4 << 20)
    a0, an = chunks[0]
    pos = {"first": a0 + (4 << 20), "middle": a0 + (4 << 20) + (2 << 20) + 1,
           "last": a0 + (8 << 20) - 1, "last_of_short_block": a0 + an - 1}[where]
    bad = bytearray(data)
    bad[pos] ^= 0x40
    p2 = tmp_path / "bad.bin"
    p2.write_bytes(bytes(bad))
    ck2 = (str(p2), bytes(bad), chunks, ckpt[3])
    r, dsts, _ = _run(reader, ck2, blocks, io=io)
    assert not r["ok"] and r["wrote"]
    mm = r["mismatch"]
    k = next(i for i, b in enumerate(blocks) if b[1] <= pos < b[1] + b[2])
    s, ln = int(blocks[k][1]), int(blocks[k][2])
    assert (mm["offset"], mm["length"], mm["file_index"]) == (s, ln, 0)
    assert mm["expected"] == xxhash.xxh3_64_intdigest(data[s:s + ln])
    assert mm["got"] == xxhash.xxh3_64_intdigest(bytes(bad[s:s + ln]))
    assert "checksum mismatch" in r["error"] and str(p2) in r["error"]
    assert f"block at offset {s}" in r["error"] and f"{mm['expected']:016x}" in r["error"]


def test_mismatch_stops_the_other_threads(reader, ckpt, tmp_path):
    """A bad first block with one thread: no later block is read."""
    path, data, chunks, _ = ckpt
    blocks = blocks_for(data, chunks, 65536)
    bad = bytearray(data)
    bad[chunks[0][0] + 10] ^= 1
    p2 = tmp_path / "bad.bin"
    p2.write_bytes(bytes(bad))
    r, dsts, _ = _run(reader, (str(p2), bytes(bad), chunks, None), blocks, threads=1,
                      op_set=_op_set(ckpt))
    assert r["mismatch"]["offset"] == chunks[0][0]
    assert r["bytes_hashed"] == 65536
    assert (dsts[3] == POISON).all()  # the table's ops never ran


def _expect_refused(reader, ckpt, blocks, msg, failed_op=None, op_set=None):
    r, dsts, _ = _run(reader, ckpt, blocks, op_set=op_set)
    assert not r["ok"] and not r["wrote"] and msg in r["error"], r["error"]
    if failed_op is not None:
        assert r["failed_op"] == failed_op
    assert all((d == POISON).all() for d in dsts)


def test_uncovered_bytes_refused(reader, ckpt):
    _, data, chunks, _ = ckpt
    blocks = blocks_for(data, chunks, 4 << 20)
    _expect_refused(reader, ckpt, np.delete(blocks, 1, axis=0), "not covered by any verify block",
                    failed_op=0)
    _expect_refused(reader, ckpt, blocks[:0], "not covered", failed_op=0)


def test_overlapping_and_out_of_range_blocks_refused(reader, ckpt):
    _, data, chunks, _ = ckpt
    blocks = blocks_for(data, chunks, 4 << 20)
    ov = blocks.copy()
    ov[1, 1] -= 1
    _expect_refused(reader, ckpt, ov, "overlap")
    past = np.vstack([blocks, [[0, len(data) - 10, 11, 0]]])
    _expect_refused(reader, ckpt, past, "past end of file")
    neg = np.vstack([blocks, [[0, -1, 5, 0]]])
    _expect_refused(reader, ckpt, neg, "negative")
    badf = np.vstack([blocks, [[3, 0, 5, 0]]])
    _expect_refused(reader, ckpt, badf, "file index out of range")


def test_block_cutting_an_element_refused(reader, ckpt):
    _, data, chunks, _ = ckpt
    b0, bn = chunks[1]
    # table blocks that start 2 bytes into an element
    cut = 100 * COLS * 4 + 1002  # inside the converted rows (op below), 2 bytes into a float
    rows = [(0, chunks[0][0], chunks[0][1], 0), (0, b0, cut, 0), (0, b0 + cut, bn - cut, 0)]
    blocks = np.array(rows, dtype=np.int64)
    conv = [o for o in _op_set(ckpt) if o[1] != 0][:1]
    _expect_refused(reader, ckpt, blocks, "cuts an element", failed_op=0, op_set=conv)


def test_empty_and_unused_blocks(reader, ckpt):
    """Blocks no op touches are still hashed (the caller asked); a zero-length block hashes the
    empty string."""
    path, data, chunks, _ = ckpt
    blocks = blocks_for(data, chunks, 4 << 20)
    extra = np.array([[0, 0, 0, np.array(xxhash.xxh3_64_intdigest(b""), dtype=np.uint64)
                       .view(np.int64)], [0, 10, 90, np.array(xxhash.xxh3_64_intdigest(
                           data[10:100]), dtype=np.uint64).view(np.int64)]], dtype=np.int64)
    r, dsts, op_set = _run(reader, ckpt, np.vstack([extra, blocks]))
    assert r["ok"], r["error"]
    assert r["bytes_hashed"] == sum(c[1] for c in chunks) + 90
