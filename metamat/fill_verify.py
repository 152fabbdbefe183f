"""Verify a load against a checksum manifest while it streams (``load_targets(verify=True)``).

The manifest (:mod:`metamat.checkpoint.checksum`) holds an xxh3_64 digest per ``block_bytes``
block of every saved chunk. Every block a load touches is checked, by streaming its bytes
through one xxh3_64 state in file order.

CPU destinations (:func:`execute_verified`, used by ``execute_plan``): the raw contiguous
ops (row blocks: the bulk of TorchRec and DTensor loads) are read here, one manifest block
per task on ``io_threads`` Python threads (``pread`` and xxh3 release the GIL): 1 MiB is
``pread`` into the destination and hashed at once, while it is in cache, so the bytes hashed
are exactly the bytes the model receives and nothing is read twice. The block's bytes the
rank does not need (block ends) are read into a scratch buffer and hashed. Strided column
slices and dtype-converting ops run on the C++ reader first; their blocks are then read
again from the file and hashed (that re-read is ``LoadStats.bytes_reread``).

Staged destinations (:class:`StreamVerifier`, CUDA through the pinned ring): after each
staged chunk is read, its blocks are hashed in the staging buffer (raw contiguous ops), the
rest re-read from the file, before the copies to the device are issued.

Bytes the manifest does not cover, or data files whose size differs from the manifest's
record, raise :class:`ChecksumMismatchError` (the manifest belongs to another checkpoint).
"""
from __future__ import annotations

import bisect
import ctypes
import os
from typing import Dict, List, Optional, Sequence, Tuple

from .checkpoint.base import Checkpoint
from .checkpoint.checksum import _PIECE, Manifest, read_manifest, sidecar_path
from .checkpoint.errors import ChecksumMismatchError, MissingFileError, ReadError

__all__ = ["StreamVerifier", "load_manifest"]


def load_manifest(ckpt: Checkpoint) -> Manifest:
    """The sidecar manifest of ``ckpt`` (for ``verify=True``).

    Raises:
        MissingFileError: there is none; the message names the path it is expected at.
        InvalidHeaderError: it does not parse.
    """
    side = sidecar_path(ckpt.path)
    if not os.path.exists(side):
        raise MissingFileError(
            "verify=True needs a checksum manifest, and there is none (write it with "
            f"`python -m metamat checksum {ckpt.path}`)", file=side)
    return read_manifest(side)


_Key = Tuple[int, int]  # (chunk index in the manifest, block index)


class StreamVerifier:
    """Checks the blocks each batch of a load touched, right after it ran (the staging
    ring reuses its buffers, so their bytes cannot wait); also the geometry (which manifest
    blocks an op touches) and the files for :class:`_ReadVerifier`.

    Args:
        manifest: the checkpoint's manifest.
        files: the plan's data files (``ReadOp.file_index`` indexes them).

    Raises:
        ChecksumMismatchError: a data file's size differs from the manifest's.
    """

    def __init__(self, manifest: Manifest, files: Sequence[str]) -> None:
        self.m = manifest
        self.files = list(files)
        self.bytes_hashed = 0  # block bytes hashed (memory + file)
        self.bytes_reread = 0  # of which read again from the files
        self.blocks = 0
        self._chunks: Dict[int, Tuple[List[int], List[int]]] = {}  # file idx -> starts, chunk ids
        by_path: Dict[str, List[int]] = {}
        for ci, c in enumerate(manifest.chunks):
            by_path.setdefault(manifest.abspath(c.file), []).append(ci)
        rel = {manifest.abspath(k): v for k, v in manifest.files.items()}
        self._index: Dict[str, int] = {}
        for fi, f in enumerate(self.files):
            p = os.path.normpath(os.path.abspath(f))
            self._index[p] = fi
            ids = sorted(by_path.get(p, ()), key=lambda i: manifest.chunks[i].byte_offset)
            self._chunks[fi] = ([manifest.chunks[i].byte_offset for i in ids], ids)
            want = rel.get(p)
            try:
                size = os.stat(f).st_size
            except FileNotFoundError:
                raise MissingFileError("data file does not exist", file=f) from None
            if want is None:
                raise ChecksumMismatchError("the checksum manifest does not list this file "
                                            "(written for another checkpoint?)", file=f)
            if size != want:
                raise ChecksumMismatchError(f"file is {size} B, the manifest recorded "
                                            f"{want} B", file=f)
        self._fds: Dict[int, int] = {}
        self._segs: Dict[_Key, List[Tuple[int, int, int]]] = {}  # block -> (start, end, addr)
        self._done: set = set()

    # -- geometry ---------------------------------------------------------------------------

    def _span(self, op) -> Tuple[int, int]:
        return op.file_offset, op.file_offset + (op.rows - 1) * op.src_stride + op.row_bytes

    def _overlaps(self, op):
        """(chunk id, lo, hi) for each manifest chunk the op's span overlaps (clipped)."""
        lo, hi = self._span(op)
        starts, ids = self._chunks[op.file_index]
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        out, covered = [], 0
        while k < len(ids):
            c = self.m.chunks[ids[k]]
            if c.byte_offset >= hi:
                break
            a, b = max(lo, c.byte_offset), min(hi, c.byte_offset + c.nbytes)
            if a < b:
                out.append((ids[k], a, b))
                covered += b - a
            k += 1
        if covered < hi - lo:
            raise ChecksumMismatchError(
                f"bytes [{lo}, {hi}) are read but the checksum manifest does not cover them "
                "all (written for another checkpoint?)", file=self.files[op.file_index])
        return out

    # -- per batch --------------------------------------------------------------------------

    def after_batch(self, b: int, ops: Sequence, ptrs: Sequence[int]) -> None:
        """Record what batch ``b``'s ``ops`` (just executed; ``ptrs[op.dst_index]`` is the
        destination base address) wrote, and verify every block they touch: bytes they
        wrote raw and contiguous are hashed in the destination, the rest read from the file.

        Raises:
            ChecksumMismatchError: a block's digest differs (names file, tensor, chunk, bytes).
        """
        B = self.m.block_bytes
        ready = []
        for op in ops:
            direct = op.rows == 1 and op.src_dtype == op.dst_dtype
            lo = op.file_offset
            base = ptrs[op.dst_index] + op.dst_offset
            for ci, a, z in self._overlaps(op):
                c0 = self.m.chunks[ci].byte_offset
                for i in range((a - c0) // B, (z - 1 - c0) // B + 1):
                    key = (ci, i)
                    if key in self._done:
                        continue
                    if direct:
                        s = max(a, c0 + i * B)
                        e = min(z, c0 + (i + 1) * B)
                        self._segs.setdefault(key, []).append((s, e, base + (s - lo)))
                    ready.append(key)
        for key in ready:
            if key not in self._done:
                self._done.add(key)
                self._verify(key, self._segs.pop(key, ()))

    def _fd(self, fi: int) -> int:
        fd = self._fds.get(fi)
        if fd is None:
            try:
                fd = os.open(self.files[fi], os.O_RDONLY)
            except OSError as e:
                raise ReadError(f"cannot open data file ({e.strerror or e})",
                                file=self.files[fi]) from None
            self._fds[fi] = fd
        return fd

    def _from_file(self, h, key: _Key, start: int, end: int) -> None:
        path = self.m.abspath(self.m.chunks[key[0]].file)
        fd = self._fd(self._index[path])
        pos = start
        while pos < end:
            buf = os.pread(fd, min(_PIECE, end - pos), pos)
            if not buf:
                raise ChecksumMismatchError(f"bytes [{pos}, {end}) are past the end of the file",
                                            file=path, tensor=self.m.chunks[key[0]].tensor)
            h.update(buf)
            pos += len(buf)
        self.bytes_reread += end - start

    def _verify(self, key: _Key, segs) -> None:
        import xxhash

        ci, i = key
        c = self.m.chunks[ci]
        B = self.m.block_bytes
        b0 = c.byte_offset + i * B
        b1 = min(b0 + B, c.byte_offset + c.nbytes)
        h = xxhash.xxh3_64()
        pos = b0
        for s, e, addr in sorted(segs):
            if e <= pos:
                continue
            if s > pos:
                self._from_file(h, key, pos, s)
            else:
                addr += pos - s
                s = pos
            h.update((ctypes.c_char * (e - s)).from_address(addr))
            pos = e
        if pos < b1:
            self._from_file(h, key, pos, b1)
        self.bytes_hashed += b1 - b0
        self.blocks += 1
        got = h.hexdigest()
        if got != c.blocks[i]:
            path = self.m.abspath(c.file)
            raise ChecksumMismatchError(
                f"chunk at {tuple(c.offsets)}: bytes [{b0}, {b1}) hash {got}, the manifest "
                f"says {c.blocks[i]} ({self.m.algorithm})", file=path, tensor=c.tensor,
                chunk=tuple(c.offsets), byte_range=(b0, b1))

    def finish(self) -> None:
        """Verify blocks still pending (none: :meth:`after_batch` verifies at once)."""
        for key in sorted(k for k in self._segs if k not in self._done):
            self._done.add(key)
            self._verify(key, self._segs.pop(key))

    def close(self) -> None:
        """Close the files (on every exit path)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._segs.clear()


# ---------------------------------------------------------------------------------------------
# read and hash in one pass (the CPU path of execute_plan with verify)

_SLICE = 1 << 20  # read then hash this much at a time: hashed while still in the L2 cache


def _pread_into(fd: int, mv: memoryview, pos: int, path: str) -> None:
    done = 0
    n = len(mv)
    while done < n:
        try:
            got = os.preadv(fd, [mv[done:]], pos + done)
        except OSError as e:
            raise ReadError(f"read of [{pos + done}, {pos + n}) failed "
                            f"({e.strerror or e})", file=path) from None
        if got <= 0:
            raise ReadError(f"short read: [{pos + done}, {pos + n}) is past the end of the "
                            "file", file=path)
        done += got


class _ReadVerifier(StreamVerifier):
    """Reads each contiguous raw op itself, block by block: ``pread`` 1 MiB into the
    destination, hash it while it is in cache, next; every other byte of the block is read
    into a scratch buffer and hashed. Each byte the model receives is the byte hashed."""

    def jobs(self, direct: Sequence, others: Sequence, ptrs: Sequence[int]):
        """One job per touched block, in file order: (key, [(start, end, addr)])."""
        B = self.m.block_bytes
        segs: Dict[_Key, list] = {}
        for op, is_direct in [(o, True) for o in direct] + [(o, False) for o in others]:
            lo = op.file_offset
            base = ptrs[op.dst_index] + op.dst_offset
            for ci, a, z in self._overlaps(op):
                c0 = self.m.chunks[ci].byte_offset
                for i in range((a - c0) // B, (z - 1 - c0) // B + 1):
                    lst = segs.setdefault((ci, i), [])
                    if is_direct:
                        s, e = max(a, c0 + i * B), min(z, c0 + (i + 1) * B)
                        lst.append((s, e, base + (s - lo)))
        order = sorted(segs, key=lambda k: (self.m.chunks[k[0]].file,
                                            self.m.chunks[k[0]].byte_offset, k[1]))
        return [(k, segs[k]) for k in order]

    def open_all(self) -> None:
        for fi in range(len(self.files)):
            self._fd(fi)

    def read_verify(self, key: _Key, segs) -> Tuple[int, int]:
        """Fill the block's destination segments from the file and check the block.

        Returns:
            (bytes read into destinations, bytes read besides).
        """
        import xxhash

        ci, i = key
        c = self.m.chunks[ci]
        B = self.m.block_bytes
        b0 = c.byte_offset + i * B
        b1 = min(b0 + B, c.byte_offset + c.nbytes)
        path = self.m.abspath(c.file)
        fd = self._fds[self._index[path]]
        h = xxhash.xxh3_64()
        scratch = None
        pos, into, extra = b0, 0, 0

        def from_file(a: int, z: int) -> None:
            nonlocal scratch, extra
            if scratch is None:
                scratch = bytearray(min(_SLICE, B))
            while a < z:
                n = min(len(scratch), z - a)
                mv = memoryview(scratch)[:n]
                _pread_into(fd, mv, a, path)
                h.update(mv)
                a += n
                extra += n

        for s, e, addr in sorted(segs):
            dst = memoryview((ctypes.c_char * (e - s)).from_address(addr)).cast("B")
            if s > pos:
                from_file(pos, s)
                pos = s
            for p in range(s, e, _SLICE):
                q = min(e, p + _SLICE)
                piece = dst[p - s:q - s]
                _pread_into(fd, piece, p, path)
                into += q - p
                if q > pos:  # bytes before pos were hashed already (overlapping targets)
                    h.update(piece[max(0, pos - p):])
                    pos = q
        if pos < b1:
            from_file(pos, b1)
        got = h.hexdigest()
        if got != c.blocks[i]:
            raise ChecksumMismatchError(
                f"chunk at {tuple(c.offsets)}: bytes [{b0}, {b1}) hash {got}, the manifest "
                f"says {c.blocks[i]} ({self.m.algorithm})", file=path, tensor=c.tensor,
                chunk=tuple(c.offsets), byte_range=(b0, b1))
        return into, extra


def execute_verified(plan, manifest: Manifest, *, threads: int, run_cpp, batch_bytes: int,
                     progress=None) -> Tuple[int, int, int]:
    """``execute_plan`` with verification, for CPU destinations.

    Raw contiguous ops (row blocks: the bulk of TorchRec and DTensor loads) are read here,
    by ``threads`` Python threads (``pread`` and xxh3 both release the GIL), 1 MiB at a time
    into the destination and hashed while in cache. Other ops (strided column slices, dtype
    conversion) run on the C++ reader (``run_cpp(ops) -> bytes read``) first; their blocks
    are then read again from the file and hashed. Work runs in groups of ``batch_bytes`` so
    a KeyboardInterrupt lands between groups; the pool is joined on every exit path.

    Returns:
        (bytes read, bytes hashed, bytes read beyond what the destinations received).

    Raises:
        ChecksumMismatchError, ReadError.
    """
    from concurrent.futures import ThreadPoolExecutor

    from .fill_load import _batches

    direct = [o for o in plan.ops if o.rows == 1 and o.src_dtype == o.dst_dtype]
    others = [o for o in plan.ops if not (o.rows == 1 and o.src_dtype == o.dst_dtype)]
    total = sum(o.src_bytes for o in plan.ops)
    done = read = 0
    v = _ReadVerifier(manifest, plan.files)
    ptrs = [t.tensor.data_ptr() for t in plan.targets]
    jobs = v.jobs(direct, others, ptrs)
    hashed = extra = 0
    pool = None
    try:
        for ops in _batches(others, batch_bytes):
            read += run_cpp(ops)
            done += sum(o.src_bytes for o in ops)
            if progress is not None:
                progress(done, total)
        v.open_all()
        pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="metamat-read-verify")
        group, size = [], 0
        groups = []
        for key, segs in jobs:
            group.append((key, segs))
            size += sum(e - s for s, e, _ in segs)
            if size >= batch_bytes:
                groups.append((group, size))
                group, size = [], 0
        if group:
            groups.append((group, size))
        for group, size in groups:
            for into, ext in pool.map(lambda j: v.read_verify(*j), group):
                read += into + ext
                extra += ext
            for key, _ in group:
                c = v.m.chunks[key[0]]
                hashed += min(v.m.block_bytes, c.nbytes - key[1] * v.m.block_bytes)
            done += size
            if progress is not None:
                progress(min(done, total), total)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        v.close()
    return read, hashed, extra
