"""Verify a load against a checksum manifest while it streams (``verify=True``).

The manifest (:mod:`metamat.checkpoint.checksum`) holds an xxh3_64 digest per ``block_bytes``
block of every saved chunk. :class:`BlockIndex` finds the blocks a batch of read ops touches
and hands them to the C++ reader (``_C.read_plan(verify_addr=...)``), which hashes each block
right after its bytes are read, in place in the destination for raw contiguous reads (the
bytes hashed are the bytes the model receives) and in the bounce buffer otherwise; block bytes
no op needs are read only to complete the hash. The first block whose digest differs fails the
call before the next piece is written.

Bytes the manifest does not cover, or data files whose size differs from the manifest's
record, raise :class:`ChecksumMismatchError` before anything is read (the manifest belongs to
another checkpoint). Checkpoints in S3 are verified by :mod:`.remote` with the same index.
"""
from __future__ import annotations

import bisect
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..checkpoint import storage as fs
from ..checkpoint.base import Checkpoint
from ..checkpoint.checksum import ChunkSum, Manifest, read_manifest, sidecar_path
from ..checkpoint.errors import (ChecksumMismatchError, InvalidHeaderError, MissingFileError,
                                 ReadError)
from .ops import ReadOp

__all__ = ["BlockIndex", "load_manifest", "resolve_manifest"]


def load_manifest(ckpt: Checkpoint) -> Manifest:
    """The sidecar manifest of ``ckpt`` (for ``verify=True``).

    Raises:
        MissingFileError: there is none; the message names the path it is expected at.
        InvalidHeaderError: it does not parse.
    """
    # an s3:// checkpoint: its sidecar is read with the options it was opened with (those of
    # the checkpoint a view stands for)
    opts = getattr(getattr(ckpt, "ckpt", ckpt), "storage_options", None)
    with fs.storage_for(ckpt.path).opening(ckpt.path, opts):
        side = sidecar_path(ckpt.path)
        if not fs.exists(side):
            raise MissingFileError(
                "verify=True needs a checksum manifest, and there is none (write it with "
                f"`python -m metamat checksum {ckpt.path}`)", file=side)
        return read_manifest(side)


def resolve_manifest(ckpt: Checkpoint, verify) -> Optional[Manifest]:
    """``verify`` argument -> a Manifest or None (True: read the checkpoint's sidecar).

    Raises:
        MissingFileError: True and there is no sidecar (the message names its path).
        InvalidHeaderError: the sidecar does not parse.
        TypeError: ``verify`` is neither a bool nor a Manifest.
    """
    if verify is None or verify is False:
        return None
    if verify is True:
        return load_manifest(ckpt)
    if isinstance(verify, Manifest):
        return verify
    raise TypeError(f"verify must be a bool or a Manifest, got {type(verify).__name__}")


def block_index(verify: Optional[Manifest], files) -> Optional["BlockIndex"]:
    """The reader's block array for a load plan's ``files``, or None when not verifying."""
    return None if verify is None else BlockIndex(verify, files)


def _stat_size(f: str) -> int:
    try:
        return os.stat(f).st_size
    except FileNotFoundError:
        raise MissingFileError("data file does not exist", file=f) from None
    except OSError as e:  # symlink loop, permission
        raise ReadError(f"cannot stat data file ({e.strerror or e})", file=f) from None


class BlockIndex:
    """The manifest's blocks, indexed by the plan's files.

    Args:
        manifest: the checkpoint's manifest.
        files: the plan's data files (``ReadOp.file_index`` indexes them).
        sizes: their sizes, where they are already known (S3 objects as opened); else each
            file is stat'ed.

    Raises:
        MissingFileError: a data file is gone.
        ChecksumMismatchError: a file the manifest does not list, or whose size differs.
        InvalidHeaderError: a block size that is not a multiple of 8 bytes.
    """

    def __init__(self, manifest: Manifest, files: Sequence[str],
                 sizes: Optional[Sequence[int]] = None) -> None:
        if manifest.block_bytes % 8:
            # a block edge inside an element of a converting read cannot be hashed as read
            raise InvalidHeaderError(
                f"checksum manifest block size {manifest.block_bytes} B is not a multiple of 8; "
                "rewrite it with `python -m metamat checksum CKPT`", file=manifest.root)
        self.m = manifest
        self.files = list(files)
        by_path: Dict[str, List[int]] = {}
        for ci, c in enumerate(manifest.chunks):
            by_path.setdefault(manifest.abspath(c.file), []).append(ci)
        recorded = {manifest.abspath(k): v for k, v in manifest.files.items()}
        self._chunks: List[Tuple[List[int], List[int]]] = []  # per file: starts, chunk ids
        for fi, f in enumerate(self.files):
            p = fs.normpath(fs.abspath(f))
            ids = sorted(by_path.get(p, ()), key=lambda i: manifest.chunks[i].byte_offset)
            self._chunks.append(([manifest.chunks[i].byte_offset for i in ids], ids))
            size = sizes[fi] if sizes is not None else _stat_size(f)
            want = recorded.get(p)
            if want is None:
                raise ChecksumMismatchError("the checksum manifest does not list this file "
                                            "(written for another checkpoint?)", file=f)
            if size != want:
                raise ChecksumMismatchError(f"file is {size} B, the manifest recorded "
                                            f"{want} B", file=f)
        self._where: Dict[Tuple[int, int], Tuple[ChunkSum, int]] = {}

    def _touched(self, op: ReadOp):
        """(chunk id, first block, last block) for each manifest chunk ``op`` reads from."""
        lo = op.file_offset
        hi = lo + (op.rows - 1) * op.src_stride + op.row_bytes
        starts, ids = self._chunks[op.file_index]
        k = max(0, bisect.bisect_right(starts, lo) - 1)
        covered = 0
        B = self.m.block_bytes
        while k < len(ids):
            c = self.m.chunks[ids[k]]
            if c.byte_offset >= hi:
                break
            a, z = max(lo, c.byte_offset), min(hi, c.byte_offset + c.nbytes)
            if a < z:
                covered += z - a
                yield ids[k], (a - c.byte_offset) // B, (z - 1 - c.byte_offset) // B
            k += 1
        if covered < hi - lo:
            raise ChecksumMismatchError(
                f"bytes [{lo}, {hi}) are read but the checksum manifest does not cover them "
                "all (written for another checkpoint?)", file=self.files[op.file_index])

    def blocks(self, ops: Sequence[ReadOp]) -> np.ndarray:
        """The (n, 4) int64 block array the reader verifies ``ops`` against: file index,
        offset, length, digest (its 64 bits as int64), sorted, each block once.

        Raises:
            ChecksumMismatchError: an op reads bytes the manifest does not cover.
        """
        B = self.m.block_bytes
        seen: Dict[Tuple[int, int], Tuple[int, int, int, int]] = {}
        for op in ops:
            for ci, b0, b1 in self._touched(op):
                c = self.m.chunks[ci]
                for i in range(b0, b1 + 1):
                    if (ci, i) in seen:
                        continue
                    off = c.byte_offset + i * B
                    n = min(B, c.byte_offset + c.nbytes - off)
                    seen[(ci, i)] = (op.file_index, off, n, int(c.blocks[i], 16))
                    self._where[(op.file_index, off)] = (c, i)
        rows = sorted(seen.values())
        arr = np.array([r[:3] for r in rows], dtype=np.int64).reshape(-1, 3)
        digests = np.array([r[3] for r in rows], dtype=np.uint64).view(np.int64)
        return np.ascontiguousarray(np.column_stack([arr, digests]) if rows
                                    else np.empty((0, 4), dtype=np.int64))

    def mismatch_error(self, mismatch: dict) -> ChecksumMismatchError:
        """The named error for the reader's first mismatching block."""
        fi, off, n = mismatch["file_index"], mismatch["offset"], mismatch["length"]
        c, i = self._where.get((fi, off), (None, None))
        got = f"{mismatch['got'] & (2**64 - 1):016x}"
        want = f"{mismatch['expected'] & (2**64 - 1):016x}"
        return ChecksumMismatchError(
            (f"chunk at {tuple(c.offsets)}: " if c is not None else "")
            + f"bytes [{off}, {off + n}) hash {got}, the manifest says {want} "
            f"({self.m.algorithm})", file=self.files[fi],
            tensor=c.tensor if c is not None else None,
            chunk=tuple(c.offsets) if c is not None else None, byte_range=(off, off + n))
