"""Checksum manifests of checkpoints in S3: build one (``checksum s3://... --out FILE``) or
re-hash every block against one (``checksum s3://... --verify``).

Each data object is pinned (its size, and its ETag, version or Last-Modified, as an open
records them), then every block is one ranged GET requiring that pin, ``max_concurrency`` at a
time, hashed as it arrives: memory stays at about ``max_concurrency`` blocks, and an object
rewritten during the run fails with a ReadError instead of mixing two versions.
"""
from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Sequence, Tuple

from . import storage as fs
from .manifest import ChunkSum, Manifest, VerifyResult, block_mismatch, block_span, xxh3_64
from .errors import ChecksumMismatchError, MissingFileError

__all__ = ["build_remote", "verify_remote"]


def _hashes(pins: Dict[str, tuple], blocks: Sequence[Tuple[str, int, int]]) -> Iterator[str]:
    """xxh3_64 hex digests of ``(url, first byte, length)`` blocks, in order, fetched
    concurrently with each object's pin required."""
    xxh3 = xxh3_64()

    def digest(block) -> str:
        url, b0, n = block
        sess, size, pin = pins[url]
        h = xxh3()
        h.update(fs.fetch_range(sess, url, b0, b0 + n, pin, what="data object", size=size))
        return h.hexdigest()

    sess = next(iter(pins.values()))[0] if pins else fs.current()
    pool = ThreadPoolExecutor(max_workers=max(1, sess.max_concurrency),
                              thread_name_prefix="metamat-s3-checksum")
    try:
        yield from pool.map(digest, blocks)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def build_remote(ckpt, m: Manifest, by_file: Dict[str, List]) -> Manifest:
    """Fill ``m`` (root, format, block size set) with the chunks of ``by_file`` (object ->
    [(tensor name, Chunk)]), hashed from S3 under the pins the open recorded."""
    pins = getattr(ckpt, "remote_meta", None)
    if not pins:  # a checkpoint object built by hand: pin now, with its storage options
        with fs.storage_for(ckpt.path).opening(ckpt.path,
                                               getattr(ckpt, "storage_options", None)):
            pins = {f: fs.remote_meta(f) for f in by_file}
    B = m.block_bytes
    blocks, chunks = [], []
    for f, items in sorted(by_file.items()):
        rel = posixpath.relpath(f, m.root)
        m.files[rel] = pins[f][1]
        for name, c in sorted(items, key=lambda it: (it[1].byte_offset, it[0])):
            n = len(range(0, c.nbytes, B))
            blocks += [(f, c.byte_offset + b, min(B, c.nbytes - b)) for b in range(0, c.nbytes, B)]
            chunks.append((rel, name, c, n))
    digests = iter(list(_hashes(pins, blocks)))
    for rel, name, c, n in chunks:
        m.chunks.append(ChunkSum(rel, name, tuple(c.offsets), c.byte_offset, c.nbytes,
                                 tuple(next(digests) for _ in range(n))))
    return m


def _pins(m: Manifest) -> Dict[str, Tuple[object, int, object]]:
    """url -> (session, size, pin) of every object the manifest names, sizes checked."""
    out = {}
    for rel in sorted(set(m.files) | {c.file for c in m.chunks}):
        url = m.abspath(rel)
        try:
            out[url] = fs.remote_meta(url)
        except FileNotFoundError:
            raise MissingFileError("data object does not exist", file=url) from None
        want = m.files.get(rel)
        if want is not None and out[url][1] != want:
            raise ChecksumMismatchError(f"object is {out[url][1]} B, the manifest recorded "
                                        f"{want} B", file=url)
    return out


def verify_remote(m: Manifest, res: VerifyResult) -> VerifyResult:
    """Every block of every chunk of ``m`` (an ``s3://`` root), added to ``res``.

    Raises:
        ChecksumMismatchError: the first block (in manifest order) that differs, or an object
            whose size differs. MissingFileError: an object is gone. ReadError: an object
            changed during the run, or the store failed after retries.
    """
    pins = _pins(m)
    jobs = [(c, i) for c in m.chunks for i in range(len(c.blocks))]
    blocks = [(m.abspath(c.file), *block_span(m, c, i)) for c, i in jobs]
    hashes = _hashes(pins, blocks)
    try:
        for (c, i), got in zip(jobs, hashes):
            if got != c.blocks[i]:
                raise block_mismatch(m, c, i, got)
            res.blocks += 1
            res.bytes_hashed += block_span(m, c, i)[1]
    finally:
        hashes.close()  # the pool's queued GETs cancelled, its threads joined
    return res
