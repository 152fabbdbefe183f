"""Verify a load from S3 against the checkpoint's checksum manifest (``verify=True``).

The file reader hashes each block as its threads read it (:mod:`.verify`). Ranged GETs land
in a host buffer, or straight in a destination (large contiguous ops), so a block is hashed
once all of its bytes have arrived. Requests are not widened (a destination holds only its
op's bytes, and a request through the buffer would fetch the block it shares with the next
request twice): the parts of the touched blocks that no request reads come by extra requests
through the buffer. A block inside one request is hashed there; a block spread over several
is assembled from its parts (those in the buffer copied out, since the next batch reuses it)
once the last one has arrived. A request through the buffer is copied into place only after
the blocks it completes were checked; a destination read directly is fresh memory that
``materialize`` discards on error.

Hashing is xxh3_64 (the ``xxhash`` package, which releases the GIL) on the fetch pool's
threads. The first block that differs raises a
:class:`~metamat.checkpoint.errors.ChecksumMismatchError` naming the object, tensor, chunk
and byte range.
"""
from __future__ import annotations

import bisect
from concurrent.futures import Executor
from typing import Dict, List, Sequence, Set, Tuple

from ..checkpoint.manifest import Manifest, xxh3_64
from .ops import ReadOp
from .verify import BlockIndex

__all__ = ["RemoteVerifier"]

_MASK = (1 << 64) - 1


def _digest(parts: Sequence) -> int:
    h = xxh3_64()()
    for p in parts:
        h.update(p)
    return h.intdigest()


class RemoteVerifier:
    """The manifest blocks a remote load's ops touch, by object.

    Args:
        manifest: the checkpoint's manifest.
        files: the plan's objects (``ReadOp.file_index`` indexes them).
        sizes: their sizes as opened (checked against the manifest's record).
        ops: the ops the load reads.

    Raises:
        ChecksumMismatchError: an object the manifest does not list, a size that differs, or
            bytes an op reads that no manifest chunk covers.
    """

    def __init__(self, manifest: Manifest, files: Sequence[str], sizes: Sequence[int],
                 ops: Sequence[ReadOp]) -> None:
        self.index = BlockIndex(manifest, files, sizes=sizes)
        self._span = manifest.block_bytes
        # per object: block starts (sorted), ends, digests (64 bits, unsigned)
        self._blocks: Dict[int, Tuple[List[int], List[int], List[int]]] = {}
        for fi, off, n, digest in self.index.blocks(ops).tolist():
            starts, ends, digests = self._blocks.setdefault(fi, ([], [], []))
            starts.append(off)
            ends.append(off + n)
            digests.append(digest & _MASK)
        self._done: Set[Tuple[int, int]] = set()
        # blocks spread over several requests: (file, block start) -> {part start: bytes}
        self._parts: Dict[Tuple[int, int], Dict[int, object]] = {}
        self.bytes_verified = 0
        self.bytes_extra = 0  # read only to complete a block

    def _overlapping(self, f: int, s: int, e: int) -> range:
        """Indexes of ``f``'s blocks that overlap ``[s, e)`` (a block spans at most
        ``block_bytes``, so the search starts that far before ``s``)."""
        starts, ends, _ = self._blocks.get(f, ([], [], []))
        i = bisect.bisect_left(starts, s - self._span)
        j = bisect.bisect_left(starts, e)
        while i < j and ends[i] <= s:
            i += 1
        return range(i, j)

    def with_block_edges(self, reqs: Sequence[tuple]) -> List[tuple]:
        """``(file, start, end, direct)`` requests, with one more (through the buffer) for
        each stretch of a touched block that none of them reads, appended."""
        covered: Dict[int, List[Tuple[int, int]]] = {}
        for f, s, e, _d in reqs:
            covered.setdefault(f, []).append((s, e))
        edges = []
        for f, (starts, ends, _) in self._blocks.items():
            spans = sorted(covered.get(f, []))
            k = 0
            for b0, b1 in zip(starts, ends):
                at = b0
                while k < len(spans) and spans[k][1] <= b0:
                    k += 1
                for s, e in spans[k:]:
                    if s >= b1 or at >= b1:
                        break
                    if s > at:
                        edges.append((f, at, s))
                    at = max(at, e)
                if at < b1:
                    edges.append((f, at, b1))
        self.bytes_extra = sum(e - s for _f, s, e in edges)
        return list(reqs) + [(f, s, e, False) for f, s, e in edges]

    def check(self, arrived: Sequence[Tuple[int, int, int, memoryview, bool]],
              pool: Executor) -> None:
        """Hash the blocks the requests that have arrived complete; compare with the manifest.

        Args:
            arrived: ``(file, start, end, bytes [start, end), kept)`` per request; ``kept``:
                the bytes stay put until the load ends (a destination), else they are copied
                where a block needs them later (the buffer is reused by the next batch).
            pool: threads to hash on.

        Raises:
            ChecksumMismatchError: the first block (in request order) that differs.
        """
        todo = []  # (file, block start, length, digest, parts)
        for f, s, e, view, kept in arrived:
            starts, ends, digests = self._blocks.get(f, ([], [], []))
            for k in self._overlapping(f, s, e):
                key = (f, starts[k])
                if key in self._done:
                    continue
                b0, b1 = starts[k], ends[k]
                if s <= b0 and b1 <= e:  # whole in this request
                    parts = [view[b0 - s:b1 - s]]
                    self._parts.pop(key, None)  # parts another request brought: not needed
                else:  # spread over several requests: collect its parts
                    a, z = max(s, b0), min(e, b1)
                    got = self._parts.setdefault(key, {})
                    if z - a > len(got.get(a, b"")):  # overlapping requests: the longest
                        got[a] = view[a - s:z - s] if kept else bytes(view[a - s:z - s])
                    parts = self._complete(got, b0, b1)
                    if parts is None:
                        continue
                    del self._parts[key]
                self._done.add(key)
                todo.append((f, b0, b1 - b0, digests[k], parts))
        got = list(pool.map(lambda b: _digest(b[4]), todo))
        for (f, off, n, want, _), digest in zip(todo, got):
            if digest != want:
                raise self.index.mismatch_error({"file_index": f, "offset": off, "length": n,
                                                 "got": digest, "expected": want})
            self.bytes_verified += n

    @staticmethod
    def _complete(got: Dict[int, object], b0: int, b1: int):
        """The parts covering ``[b0, b1)`` in order, or None while some are missing."""
        parts, at = [], b0
        for start in sorted(got):
            if start > at:
                return None
            part = got[start]
            if start + len(part) <= at:
                continue  # inside what the parts before already give
            parts.append(memoryview(part)[at - start:])
            at = start + len(part)
        return parts if at >= b1 else None

    def finish(self) -> None:
        """After the last batch: every block spread over several requests was completed."""
        if self._parts:
            f, off = next(iter(self._parts))
            raise RuntimeError(f"block at byte {off} of {self.index.files[f]} was never "
                               "completed (a bug in the request plan)")
