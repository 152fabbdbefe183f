"""Property test of the S3 checksum verification's request logic (no store needed).

Random manifests (chunks with gaps, several objects, blocks of any multiple of 8 bytes),
random ops (contiguous or strided, some read straight into place, some reading the same
bytes as another), random coalescing gaps,
part sizes and batch caps: the requests go through :func:`plan_requests`,
:meth:`RemoteVerifier.with_block_edges` and :func:`batch_requests` as in
:func:`~metamat.load.remote.execute_plan_remote`, are "fetched" from the objects' bytes, and
the buffer is filled with garbage before each batch (it is reused). Checked: a clean load
verifies every block holding a byte an op reads, each once, and raises nothing; one flipped
byte in such a block always raises ChecksumMismatchError; no request reads past its object.
"""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

xxhash = pytest.importorskip("xxhash")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from metamat.checkpoint.checksum import ChunkSum, Manifest  # noqa: E402
from metamat.checkpoint.errors import ChecksumMismatchError  # noqa: E402
from metamat.load.ops import ReadOp  # noqa: E402
from metamat.load.remote import batch_requests, plan_requests  # noqa: E402
from metamat.load.remote_verify import RemoteVerifier  # noqa: E402

ROOT = "/nonexistent/ckpt"  # never opened: sizes are given, bytes come from memory


def _objects(rng: random.Random):
    """(manifest, file paths, their bytes, chunks)."""
    B = rng.choice([8, 16, 64, 104])
    files, datas, chunks, sizes = [], [], [], {}
    for fi in range(rng.randint(1, 2)):
        pos, spans = rng.choice([0, 8, 24]), []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 40) * 8
            spans.append((pos, n))
            pos += n + rng.choice([0, 0, 8, 16, 200])
        data = bytes(rng.getrandbits(8) for _ in range(pos + rng.choice([0, 8])))
        name = f"f{fi}.bin"
        for ci, (off, n) in enumerate(spans):
            blocks = tuple(xxhash.xxh3_64(data[off + b:off + min(n, b + B)]).hexdigest()
                           for b in range(0, n, B))
            chunks.append(ChunkSum(name, f"t{fi}_{ci}", (0,), off, n, blocks))
        files.append(f"{ROOT}/{name}")
        datas.append(data)
        sizes[name] = len(data)
    return Manifest(ROOT, "test", B, sizes, chunks), files, datas, chunks


def _ops(rng: random.Random, chunks, files):
    """Ops inside chunks, overlapping one another in some cases (two targets of the same
    bytes); (ops, direct flags)."""
    ops, direct, used = [], [], []
    overlap = rng.random() < 0.3
    for _ in range(rng.randint(1, 6)):
        c = rng.choice(chunks)
        fi = files.index(f"{ROOT}/{c.file}")
        a = c.byte_offset + rng.randrange(0, c.nbytes // 8) * 8
        z = a + rng.randint(1, (c.byte_offset + c.nbytes - a) // 8) * 8
        if not overlap and any(f == fi and a < zz and aa < z for f, aa, zz in used):
            continue
        used.append((fi, a, z))
        if rng.random() < 0.3 and z - a >= 32:  # strided rows of 8 bytes
            stride = rng.choice([8, 16, 24])
            rows = (z - a - 8) // stride + 1
            ops.append(ReadOp(fi, a, 8, rows, stride, 0, 0, 8, torch.uint8, torch.uint8))
            direct.append(False)
        else:
            ops.append(ReadOp(fi, a, z - a, 1, z - a, 0, 0, z - a, torch.uint8, torch.uint8))
            direct.append(rng.random() < 0.5)
    return ops, direct


def _load(seed: int, corrupt: bool, pool) -> str:
    rng = random.Random(seed)
    m, files, datas, chunks = _objects(rng)
    ops, direct = _ops(rng, chunks, files)
    if not ops:
        return "no ops"
    _pieces, reqs = plan_requests(ops, rng.choice([0, 8, 64, 1000]),
                                  rng.choice([16, 64, 100000]), direct)
    v = RemoteVerifier(m, files, [len(d) for d in datas], ops)
    rows = [(o.file_index, o.file_offset + r * o.src_stride,
             o.file_offset + r * o.src_stride + o.row_bytes) for o in ops for r in range(o.rows)]
    needed = {(f, off) for f, off, n, _ in v.index.blocks(ops).tolist()
              if any(g == f and a < off + n and off < z for g, a, z in rows)}
    served = [bytearray(d) for d in datas]
    if corrupt:
        f, off = rng.choice(sorted(needed))
        n = next(n for g, o, n, _ in v.index.blocks(ops).tolist() if (g, o) == (f, off))
        served[f][off + rng.randrange(n)] ^= 4
    reqs = v.with_block_edges(reqs)
    assert all(e <= len(datas[f]) for f, _s, e, _d in reqs), "a request past its object"
    cap = max(max((e - s for _, s, e, d in reqs if not d), default=0),
              rng.choice([1, 64, 256, 10**6]))
    buf = bytearray(1 << 16)
    try:
        for batch in batch_requests(reqs, cap):
            buf[:] = b"\xee" * len(buf)  # the previous batch's bytes are gone
            where, off, views = {}, 0, {}
            for i in batch:
                f, s, e, d = reqs[i]
                if d:  # a destination of its own, kept
                    views[i] = memoryview(bytearray(served[f][s:e]))
                else:
                    where[i] = off + s % 64
                    off += (e - s + s % 64 + 63) & ~63
                    assert off <= len(buf), "the test's buffer is too small for this batch"
                    buf[where[i]:where[i] + e - s] = served[f][s:e]
            mv = memoryview(buf)
            v.check([(f, s, e, views[i], True) if d else
                     (f, s, e, mv[where[i]:where[i] + e - s], False)
                     for i in batch for f, s, e, d in [reqs[i]]], pool)
        v.finish()
    except ChecksumMismatchError:
        assert corrupt, f"seed {seed}: a clean load raised"
        return "caught"
    assert not corrupt, f"seed {seed}: a flipped byte was not caught"
    assert needed <= v._done, f"seed {seed}: blocks not verified: {sorted(needed - v._done)}"
    return "verified"


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


@settings(max_examples=2000, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), corrupt=st.booleans())
def test_every_needed_block_verified_and_every_flip_caught(pool, seed, corrupt):
    _load(seed, corrupt, pool)
