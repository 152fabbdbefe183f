"""Integrity sidecars: per-chunk xxh3_64 checksums of any checkpoint ``open_checkpoint`` reads.

A manifest lists, for every saved chunk (one :class:`~metamat.checkpoint.base.Chunk`: a box of
one tensor and the byte range holding it), the xxh3_64 digest of each ``block_bytes`` block of
that range (blocks start at the chunk's first byte; the last may be short). Blocks rather than
one digest per chunk so that a loader reading a row block of a huge table verifies only the
blocks it touched (:func:`verify_ranges`), not the whole table.

The sidecar is JSON next to the checkpoint (:func:`sidecar_path`); file names in it are
relative to the checkpoint's root, so a checkpoint moved with its sidecar still verifies.
Only tensor bytes are covered: headers are validated structurally by the parsers instead.

Typical use::

    write_manifest("ckpt/")                       # once, after saving
    m = read_manifest("ckpt/")
    verify_manifest(m)                            # everything, or after a load:
    verify_ranges(m, reads_from_plan(plan))       # only the bytes a load read
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import storage as fs
from .access import read_metadata_file
from .atomic import atomic_write
from .base import Checkpoint, open_binary
from .errors import ChecksumMismatchError, InvalidHeaderError
from .limits import loads_json
from .manifest import (ALGORITHM, ChunkSum, Manifest, VerifyResult, block_mismatch,
                       block_span, xxh3_64)

__all__ = ["ALGORITHM", "DEFAULT_BLOCK_BYTES", "ChunkSum", "Manifest", "VerifyResult",
           "block_span", "block_mismatch",
           "sidecar_path", "build_manifest", "write_manifest", "save_manifest", "read_manifest",
           "verify_manifest", "verify_ranges", "reads_from_plan"]

#: Big enough that hashing runs at memory speed, small enough that a row-block read
#: re-hashes little beyond what it read.
DEFAULT_BLOCK_BYTES = 4 << 20
_SIDECAR_DIR = ".metamat-checksums.json"
_SIDECAR_SUFFIX = ".xxh3.json"
_PIECE = 8 << 20  # read size while hashing one block


def _root(ckpt_path: str) -> str:
    return ckpt_path if fs.isdir(ckpt_path) else fs.dirname(ckpt_path)


def sidecar_path(checkpoint_path) -> str:
    """Where the sidecar of a checkpoint lives: ``<dir>/.metamat-checksums.json`` for a
    directory, ``<file>.xxh3.json`` for a single file (or an index json); local or on S3."""
    p = fs.abspath(os.fspath(checkpoint_path))
    return fs.join(p, _SIDECAR_DIR) if fs.isdir(p) else p + _SIDECAR_SUFFIX


def _hash_range(fh, start: int, n: int, path: str, tensor: Optional[str]) -> str:
    h = xxh3_64()()
    done = 0
    while done < n:
        b = fs.pread(fh, min(_PIECE, n - done), start + done)
        if not b:
            raise ChecksumMismatchError(
                f"bytes [{start + done}, {start + n}) are past the end of the file",
                file=path, tensor=tensor)
        h.update(b)
        done += len(b)
    return h.hexdigest()


def build_manifest(ckpt: Union[Checkpoint, str, os.PathLike],
                   block_bytes: int = DEFAULT_BLOCK_BYTES) -> Manifest:
    """Hash every chunk of a checkpoint (an opened one, or a path to open).

    Raises:
        ValueError: ``block_bytes`` is not positive.
        CheckpointError: the checkpoint does not open, or a file changed while hashing.
    """
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    if not isinstance(ckpt, Checkpoint):
        from .open import open_checkpoint
        ckpt = open_checkpoint(ckpt)
    # an s3:// checkpoint's prefix is listed with the options it was opened with
    with fs.storage_for(ckpt.path).opening(ckpt.path, getattr(ckpt, "storage_options", None)):
        root = _root(ckpt.path)
    m = Manifest(root, ckpt.format, int(block_bytes), {})
    by_file: Dict[str, List] = {}
    for e in ckpt.tensors().values():
        for c in e.chunks:
            by_file.setdefault(c.file, []).append((e.name, c))
    if not fs.storage_for(ckpt.path).os_files:
        from .checksum_remote import build_remote
        return build_remote(ckpt, m, by_file)
    for f, items in sorted(by_file.items()):
        rel = os.path.relpath(f, root)
        with open_binary(f, "data file") as fh:
            m.files[rel] = os.fstat(fh.fileno()).st_size
            for name, c in sorted(items, key=lambda it: (it[1].byte_offset, it[0])):
                blocks = tuple(
                    _hash_range(fh, c.byte_offset + b, min(block_bytes, c.nbytes - b),
                                f, name) for b in range(0, c.nbytes, block_bytes))
                m.chunks.append(ChunkSum(rel, name, tuple(c.offsets), c.byte_offset, c.nbytes,
                                         blocks))
    return m


def write_manifest(ckpt: Union[Checkpoint, str, os.PathLike], out: Optional[str] = None,
                   block_bytes: int = DEFAULT_BLOCK_BYTES) -> str:
    """Build the manifest of ``ckpt`` and write it (atomically) to ``out`` or the sidecar path.

    Returns:
        The path written.

    Raises:
        ValueError: an ``s3://`` checkpoint without a local ``out`` (metamat does not write
            into the store: upload the file written as its sidecar).
        WriteError: ``out`` cannot be written (nothing is left behind).
    """
    if not isinstance(ckpt, Checkpoint):
        from .open import open_checkpoint
        ckpt = open_checkpoint(ckpt)
    if not fs.storage_for(out or ckpt.path).os_files:  # before hashing anything
        raise ValueError("metamat does not write into S3: give a local out= and upload it as "
                         "the checkpoint's sidecar (.metamat-checksums.json in its directory, "
                         "FILE.xxh3.json beside a file)")
    return save_manifest(build_manifest(ckpt, block_bytes), out or sidecar_path(ckpt.path))


def save_manifest(m: Manifest, out: str) -> str:
    """Write ``m`` to the local file ``out``, atomically; returns ``out``.

    Raises:
        WriteError: ``out`` cannot be written (nothing is left behind).
    """
    # a random temporary name created O_EXCL|O_NOFOLLOW, renamed over `out`: a symlink
    # planted in the checkpoint directory is never followed
    atomic_write(out, json.dumps(m.to_json(), separators=(",", ":")).encode(),
                 "checksum manifest")
    return out


def read_manifest(path, root: Optional[str] = None) -> Manifest:
    """Read a manifest: ``path`` is the sidecar itself or the checkpoint it sits next to.

    Args:
        root: directory file names are relative to; default: the sidecar's checkpoint root.

    Raises:
        MissingFileError: no sidecar. InvalidHeaderError: it is not a valid manifest.
    """
    p = fs.abspath(os.fspath(path))
    is_side = p.endswith(".json") and _is_sidecar(p) and not fs.isdir(p)
    side = p if is_side else sidecar_path(p)
    if root is None:
        root = fs.dirname(side)
    d = loads_json(read_metadata_file(side, "checksum manifest"), "checksum manifest", side)
    if not isinstance(d, dict):
        raise InvalidHeaderError("checksum manifest is not a JSON object", file=side)
    return Manifest.from_json(d, root, side)


def _is_sidecar(p: str) -> bool:
    return os.path.basename(p) == _SIDECAR_DIR or p.endswith(_SIDECAR_SUFFIX)


def _verify_blocks(m: Manifest, c: ChunkSum, which: Iterable[int], res: VerifyResult) -> None:
    path = m.abspath(c.file)
    with open_binary(path, "data file", tensor=c.tensor) as fh:
        size = fs.fsize(fh)
        want_size = m.files.get(c.file)
        if want_size is not None and size != want_size:
            raise ChecksumMismatchError(
                f"file is {size} B, the manifest recorded {want_size} B", file=path,
                tensor=c.tensor)
        for i in which:
            b0, n = block_span(m, c, i)
            got = _hash_range(fh, b0, n, path, c.tensor)
            res.bytes_hashed += n
            if got != c.blocks[i]:
                raise block_mismatch(m, c, i, got)
            res.blocks += 1


def verify_manifest(m: Manifest) -> VerifyResult:
    """Re-hash every block of every chunk (of an ``s3://`` checkpoint: concurrent ranged GETs,
    :mod:`.checksum_remote`).

    Raises:
        ChecksumMismatchError: the first block that differs (names file, tensor, chunk, bytes),
            or a file whose size changed. MissingFileError: a data file is gone.
    """
    if not fs.storage_for(m.root).os_files:
        from .checksum_remote import verify_remote
        return verify_remote(m, VerifyResult())
    res = VerifyResult()
    for c in m.chunks:
        _verify_blocks(m, c, range(len(c.blocks)), res)
    return res


def verify_ranges(m: Manifest, reads: Iterable[Tuple[str, int, int]]) -> VerifyResult:
    """Verify the blocks a set of reads touched.

    Args:
        m: the manifest.
        reads: ``(file, offset, nbytes)`` triples; ``file`` absolute or relative to the root.
            Every block of every chunk overlapping a read is re-hashed (once).

    Returns:
        A :class:`VerifyResult`; bytes of the reads no chunk covers are counted, not verified.

    Raises:
        ChecksumMismatchError, MissingFileError: as :func:`verify_manifest`.
    """
    by_file: Dict[str, List[ChunkSum]] = {}
    for c in m.chunks:
        by_file.setdefault(m.abspath(c.file), []).append(c)
    todo: Dict[int, set] = {}
    index = {id(c): c for c in m.chunks}
    res = VerifyResult()
    for f, off, n in reads:
        if n <= 0:
            continue
        path = m.abspath(f)
        lo, hi = off, off + n
        covered = []
        for c in by_file.get(path, ()):
            a, b = max(lo, c.byte_offset), min(hi, c.byte_offset + c.nbytes)
            if a >= b:
                continue
            covered.append((a, b))
            first = (a - c.byte_offset) // m.block_bytes
            last = (b - 1 - c.byte_offset) // m.block_bytes
            todo.setdefault(id(c), set()).update(range(first, last + 1))
        res.uncovered_bytes += n - _union_len(covered)
    for cid, blocks in todo.items():
        _verify_blocks(m, index[cid], sorted(blocks), res)
    return res


def _union_len(spans: Sequence[Tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def reads_from_plan(plan) -> List[Tuple[str, int, int]]:
    """The ``(file, offset, nbytes)`` spans a :class:`metamat.load.LoadPlan` reads
    (a strided op is one span from its first to its last byte)."""
    out = []
    for o in plan.ops:
        if o.rows <= 0 or o.row_bytes <= 0:
            continue
        out.append((plan.files[o.file_index], o.file_offset,
                    (o.rows - 1) * o.src_stride + o.row_bytes))
    return out
