"""Verify a load from S3 against the checkpoint's checksum manifest (``verify=True``).

The file reader hashes each block as its threads read it (:mod:`.verify`). Ranged GETs land
in a host buffer instead, so here each request is widened to whole manifest blocks: a block
is hashed whole or not at all. Once a batch of requests has arrived, every block inside it is
hashed (the core's xxh3_64, GIL released, on the fetch pool's threads) and compared with the manifest before a byte of
the batch is copied into a destination. The first block that differs raises a
:class:`~metamat.checkpoint.errors.ChecksumMismatchError` naming the object, tensor, chunk
and byte range. While verifying no request is read straight into a destination: every byte
passes through the buffer where it is hashed.
"""
from __future__ import annotations

import bisect
from concurrent.futures import Executor
from typing import Dict, List, Sequence, Set, Tuple

import torch

from .._ext import core
from ..checkpoint.checksum import Manifest
from .ops import ReadOp
from .verify import BlockIndex

__all__ = ["RemoteVerifier"]

_MASK = (1 << 64) - 1


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
        self.bytes_verified = 0
        self.bytes_widened = 0  # read only to complete a block

    def _overlapping(self, f: int, s: int, e: int) -> range:
        """Indexes of ``f``'s blocks that overlap ``[s, e)`` (a block spans at most
        ``block_bytes``, so the search starts that far before ``s``)."""
        starts, ends, _ = self._blocks.get(f, ([], [], []))
        i = bisect.bisect_left(starts, s - self._span)
        j = bisect.bisect_left(starts, e)
        while i < j and ends[i] <= s:
            i += 1
        return range(i, j)

    def widen(self, reqs: Sequence[tuple]) -> List[tuple]:
        """``(file, start, end, direct)`` requests, each grown to the whole blocks it
        touches."""
        out = []
        for f, s, e, d in reqs:
            starts, ends, _ = self._blocks.get(f, ([], [], []))
            hit = self._overlapping(f, s, e)
            s2 = min([s] + [starts[k] for k in hit])
            e2 = max([e] + [ends[k] for k in hit])
            self.bytes_widened += (s - s2) + (e2 - e)
            out.append((f, s2, e2, d))
        return out

    def check(self, arrived: Sequence[Tuple[int, int, int, int]], buf: torch.Tensor,
              pool: Executor) -> None:
        """Hash the blocks of requests that have arrived and compare them with the manifest.

        Args:
            arrived: ``(file, start, end, offset of start in buf)`` per request.
            buf: the host buffer (uint8) the requests were read into.
            pool: threads to hash on.

        Raises:
            ChecksumMismatchError: the first block (in request order) that differs.
        """
        todo = []  # (file, offset, length, digest, where in buf)
        for f, s, e, at in arrived:
            if at < 0 or at + (e - s) > buf.numel():  # hashed by address: never outside
                raise RuntimeError(f"request [{s}, {e}) at {at} is outside the "
                                   f"{buf.numel()} B buffer")
            starts, ends, digests = self._blocks.get(f, ([], [], []))
            for k in self._overlapping(f, s, e):
                if starts[k] < s or ends[k] > e or (f, starts[k]) in self._done:
                    continue  # hashed already, or whole in another request
                self._done.add((f, starts[k]))
                todo.append((f, starts[k], ends[k] - starts[k], digests[k],
                             at + starts[k] - s))
        base, xxh3 = buf.data_ptr(), core().xxh3_64
        got = list(pool.map(lambda b: xxh3(base + b[4], b[2]) & _MASK, todo))
        for (f, off, n, want, _), digest in zip(todo, got):
            if digest != want:
                raise self.index.mismatch_error({"file_index": f, "offset": off, "length": n,
                                                 "got": digest, "expected": want})
            self.bytes_verified += n
