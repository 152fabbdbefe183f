"""Re-hash every block of a checkpoint in S3 against its manifest (``checksum --verify``).

Each data object is pinned once (its size, and its ETag, version or Last-Modified, as an open
records them), then every block is one ranged GET requiring that pin, ``max_concurrency`` at a
time, hashed as it arrives: memory stays at about ``max_concurrency`` blocks, and an object
rewritten during the run fails with a ReadError instead of mixing two versions.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

from . import storage as fs
from .checksum import Manifest, VerifyResult, block_mismatch, block_span
from .errors import ChecksumMismatchError, MissingFileError

__all__ = ["verify_remote"]


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
    import xxhash

    pins = _pins(m)
    jobs = [(c, i) for c in m.chunks for i in range(len(c.blocks))]

    def digest(job) -> str:
        c, i = job
        url = m.abspath(c.file)
        sess, size, pin = pins[url]
        b0, n = block_span(m, c, i)
        data = fs.fetch_range(sess, url, b0, b0 + n, pin, what="data object", size=size)
        return xxhash.xxh3_64_hexdigest(data)

    sess = next(iter(pins.values()))[0] if pins else fs.current()
    pool = ThreadPoolExecutor(max_workers=max(1, sess.max_concurrency),
                              thread_name_prefix="metamat-s3-verify")
    try:
        for (c, i), got in zip(jobs, pool.map(digest, jobs)):
            if got != c.blocks[i]:
                raise block_mismatch(m, c, i, got)
            res.blocks += 1
            res.bytes_hashed += block_span(m, c, i)[1]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return res
