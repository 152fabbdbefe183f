"""The read plan of a load: which bytes of which file land where, validated before anything is
read (not to be confused with :mod:`metamat.plan`, the targets and storages of a call, nor with
TorchRec's sharding plan).

:func:`plan_reads` (pure Python, allocates nothing, reads no tensor data) matches targets to
checkpoint tensors by fqn, validates everything (shapes, dtypes, coverage, byte ranges, file
sizes and, once allocated, destinations) and intersects each target box with each saved chunk
box, emitting minimal :class:`~metamat.load.ops.ReadOp` s: one contiguous run when the
intersection spans whole rows on both sides (TW/RW blocks, whole CW column blocks), else one
strided op "rows x row_bytes" (a column slice of a wider chunk). Adjacent runs are merged.

Dtype policy (``dtype`` argument): ``None``/``"auto"`` (default) loads a saved dtype into the
same dtype bit-exactly and converts between float32, float16 and bfloat16 (round to nearest
even, as ``Tensor.to``) when the target's dtype differs; any other difference raises
:class:`DtypeMismatchError`. ``"exact"`` forbids conversion. A ``torch.dtype`` additionally
requires every saved tensor to have that dtype.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..checkpoint import storage as fs
from ..checkpoint.base import Checkpoint, Chunk, TensorEntry, itemsize
from ..checkpoint.errors import (CoverageError, DestinationError, DtypeMismatchError,
                                 MissingFileError, MissingTensorError, OverlappingChunksError,
                                 ReadError, ShapeMismatchError, TruncatedFileError, UnsupportedFormatError)
from ..dtypes import CONVERTIBLE
from ..plan import Target
from .ops import ReadOp

__all__ = ["ReadPlan", "plan_reads", "validate_destination", "check_conversion",
           "LoadPlan", "plan_load"]


@dataclass
class ReadPlan:
    """Everything a read executor needs; plain data.

    Attributes:
        files: data files, indexed by ``ReadOp.file_index``.
        targets: targets that will be loaded, indexed by ``ReadOp.dst_index``.
        ops: the reads, sorted by (file, offset).
        missing: targets whose fqn the checkpoint lacks (only when not strict).
        bytes_needed: source bytes of the regions the targets need.
        identities: per file, (st_dev, st_ino, st_size, st_mtime_ns) as recorded when the
            checkpoint was opened (-1: unchecked); the reader refuses a file that changed.
        pins: for files of a storage that pins its objects itself (S3), what the reads must
            require of each, recorded at open (``Checkpoint.remote_meta``); else None.
    """

    files: List[str]
    targets: List[Target]
    ops: List[ReadOp]
    missing: List[Target] = field(default_factory=list)
    bytes_needed: int = 0
    identities: List[Tuple[int, int, int, int]] = field(default_factory=list)
    pins: Optional[Dict[str, Any]] = None

    @property
    def src_bytes(self) -> int:
        """Source bytes the ops read (before coalescing)."""
        return sum(o.src_bytes for o in self.ops)

    def subplan(self, keep: Sequence[int]) -> "ReadPlan":
        """The part of this plan writing the targets at indices ``keep`` (renumbered)."""
        index = {old: new for new, old in enumerate(keep)}
        ops = [ReadOp(o.file_index, o.file_offset, o.row_bytes, o.rows, o.src_stride,
                      index[o.dst_index], o.dst_offset, o.dst_stride, o.src_dtype, o.dst_dtype)
               for o in self.ops if o.dst_index in index]
        return dataclasses.replace(self, targets=[self.targets[i] for i in keep], ops=ops,
                                   missing=[], bytes_needed=0)


# ---------------------------------------------------------------------------------------------
# planning


def _as2d(shape: Sequence[int]) -> Tuple[int, int]:
    """Rows × cols view of a 0-, 1- or 2-D shape (1-D is a column: its elements are rows)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return int(shape[0]), 1
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    raise ValueError(f"{len(shape)}-D")


def _off2d(offsets: Sequence[int]) -> Tuple[int, int]:
    """Row/col offset matching :func:`_as2d`."""
    if len(offsets) == 0:
        return 0, 0
    if len(offsets) == 1:
        return int(offsets[0]), 0
    return int(offsets[0]), int(offsets[1])


def check_conversion(saved: torch.dtype, dst: torch.dtype, policy) -> Optional[str]:
    """None if ``saved`` may be loaded into ``dst`` under ``policy``, else why not."""
    if isinstance(policy, torch.dtype) and saved != policy:
        return f"saved dtype {saved} is not the required {policy}"
    if saved == dst:
        return None
    if policy == "exact":
        return f"saved dtype {saved} differs from destination {dst} (dtype='exact')"
    if saved in CONVERTIBLE and dst in CONVERTIBLE:
        return None
    return f"cannot convert saved dtype {saved} to destination {dst}"


def _chunk_row_stride(entry: TensorEntry, ch: Chunk) -> int:
    """Element stride between rows of ``ch`` (2-D view); the column stride must be 1."""
    rows, cols = _as2d(ch.sizes)
    if ch.strides is None:
        return cols
    st = tuple(ch.strides)
    if len(st) == 0:
        return 1
    if len(st) == 1:
        return st[0]  # 1-D: elements are rows
    if cols > 1 and st[1] != 1:
        raise UnsupportedFormatError(
            f"chunk at {tuple(ch.offsets)} has column stride {st[1]} (a transposed view); "
            "re-save it contiguous", file=ch.file, tensor=entry.name)
    return st[0] if rows > 1 else cols


def _check_overlaps(entry: TensorEntry, boxes: List[Tuple[int, int, int, int, Chunk]]) -> None:
    """Raise if two chunk boxes (r0, r1, c0, c1, chunk) overlap; boxes that only touch are
    fine. Empty boxes hold nothing and are ignored.

    A sweep over rows, O(n log n): each box is inserted at its first row and removed after
    its last; the active boxes (those crossing the sweep row) are pairwise disjoint in
    columns, kept sorted by first column, so a new box overlaps one of them iff it overlaps
    its neighbour on either side. At one row, removals come before insertions (a box ending
    where another starts only touches it). Removals run from the last column down and
    insertions from the first column up, so the common layouts (row chunks, column chunks,
    grids) insert at the end and delete from the end of the active list.
    """
    n = len(boxes)
    if n < 2:
        return
    if all(b[2] == boxes[0][2] and b[3] == boxes[0][3] for b in boxes):  # row chunks
        rows = sorted((b[0], b[1], i) for i, b in enumerate(boxes) if b[0] < b[1])
        for (_, a1, ia), (b0, _, ib) in zip(rows, rows[1:]):
            if b0 < a1:
                _overlap(entry, boxes[ia], boxes[ib])
        return
    events = []
    for i, (r0, r1, c0, c1, _) in enumerate(boxes):
        if r0 < r1 and c0 < c1:
            events.append((r0, 1, c0, i))
            events.append((r1, 0, -c0, i))  # removals: last column first
    events.sort()
    starts: List[int] = []  # first column of each active box, ascending
    active: List[int] = []  # the boxes, same order
    for _, insert, _, i in events:
        c0, c1 = boxes[i][2], boxes[i][3]
        pos = bisect.bisect_left(starts, c0)
        if not insert:
            del starts[pos], active[pos]
            continue
        if pos < len(starts) and starts[pos] < c1:
            _overlap(entry, boxes[active[pos]], boxes[i])
        if pos > 0 and boxes[active[pos - 1]][3] > c0:
            _overlap(entry, boxes[active[pos - 1]], boxes[i])
        starts.insert(pos, c0)
        active.insert(pos, i)


def _overlap(entry: TensorEntry, a, b) -> None:
    raise OverlappingChunksError(
        f"chunks at {tuple(a[4].offsets)} and {tuple(b[4].offsets)} overlap",
        file=b[4].file, tensor=entry.name)


def _dst_row_stride(t: Target) -> int:
    """Element stride between destination rows (2-D view) from the tensor, else contiguous."""
    rows, cols = _as2d(t.local_shape)
    x = t.tensor
    if x is None:
        return cols
    if x.dim() == 1:
        return int(x.stride(0)) if x.numel() > 1 else 1
    if x.dim() == 2:
        return int(x.stride(0)) if rows > 1 else cols
    return cols


def validate_destination(t: Target) -> None:
    """Check ``t.tensor`` is a CPU or CUDA tensor of ``t.local_shape``/``t.dtype`` with unit inner
    stride and non-overlapping rows.

    Raises:
        DestinationError: anything else.
    """
    x = t.tensor
    if not isinstance(x, torch.Tensor):
        raise DestinationError("target has no allocated tensor", tensor=t.fqn)
    if x.device.type not in ("cpu", "cuda"):
        raise DestinationError(f"destination on {x.device}: the loader writes CPU and CUDA "
                               "tensors", tensor=t.fqn)
    if x.dtype != t.dtype:
        raise DestinationError(f"destination dtype {x.dtype} != target dtype {t.dtype}",
                               tensor=t.fqn)
    if tuple(x.shape) != tuple(t.local_shape):
        raise DestinationError(f"destination shape {tuple(x.shape)} != local_shape "
                               f"{tuple(t.local_shape)}", tensor=t.fqn)
    if x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1:
        raise DestinationError(f"destination inner stride {x.stride(1)} != 1", tensor=t.fqn)
    if x.dim() == 2 and x.shape[0] > 1 and x.stride(0) < x.shape[1]:
        raise DestinationError(f"destination rows overlap (stride {x.stride(0)})", tensor=t.fqn)
    if x.dim() == 1 and x.numel() > 1 and x.stride(0) != 1:
        raise DestinationError(f"destination stride {x.stride(0)} != 1", tensor=t.fqn)


def plan_reads(targets: Sequence[Target], ckpt: Checkpoint, *, strict: bool = True,
               dtype: Union[None, str, torch.dtype] = None,
               check_destinations: bool = True) -> ReadPlan:
    """Validate the load of ``targets`` from ``ckpt`` and compute the reads.

    Args:
        targets: blocks to fill; ``fqn`` is the checkpoint key.
        ckpt: an opened checkpoint.
        strict: raise if a target's fqn is absent (else report it in ``ReadPlan.missing``).
        dtype: conversion policy, see the module docstring.
        check_destinations: also validate ``target.tensor`` (off to plan before allocating).

    Returns:
        The plan. No destination is touched.

    Raises:
        MissingTensorError: strict and some fqns are absent (all are listed).
        ShapeMismatchError, DtypeMismatchError, CoverageError, OverlappingChunksError,
        DestinationError, MissingFileError, TruncatedFileError, UnsupportedFormatError.
    """
    if dtype not in (None, "auto", "exact") and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be None, 'auto', 'exact' or a torch.dtype, got {dtype!r}")
    entries = ckpt.tensors()
    missing = [t for t in targets if t.fqn not in entries]
    if missing and strict:
        names = sorted({t.fqn for t in missing})
        raise MissingTensorError(
            f"{len(names)} tensor(s) missing from checkpoint: {', '.join(names[:20])}"
            + (" ..." if len(names) > 20 else ""), names=names, file=ckpt.path)

    files: List[str] = []
    file_index: Dict[str, int] = {}
    loaded: List[Target] = []
    ops: List[ReadOp] = []
    needed = 0
    for t in targets:
        e = entries.get(t.fqn)
        if e is None:
            continue
        if len(t.local_shape) > 2 or len(t.global_shape) > 2:
            raise ShapeMismatchError(f"targets must be 0-, 1- or 2-D, got {len(t.global_shape)}"
                                     "-D", file=ckpt.path, tensor=t.fqn)
        if tuple(e.global_shape) != tuple(t.global_shape):
            raise ShapeMismatchError(f"checkpoint shape {tuple(e.global_shape)} != model shape "
                                     f"{tuple(t.global_shape)}", file=ckpt.path, tensor=t.fqn)
        if len(t.offsets) != len(t.global_shape) or len(t.local_shape) != len(t.global_shape) \
                or any(o < 0 or s < 0 or o + s > g for o, s, g in
                       zip(t.offsets, t.local_shape, t.global_shape)):
            raise ShapeMismatchError(f"block offsets {tuple(t.offsets)} shape "
                                     f"{tuple(t.local_shape)} outside {tuple(t.global_shape)}",
                                     tensor=t.fqn)
        why = check_conversion(e.dtype, t.dtype, dtype)
        if why is not None:
            raise DtypeMismatchError(why, file=ckpt.path, tensor=t.fqn)
        if check_destinations:
            validate_destination(t)

        di = len(loaded)
        loaded.append(t)
        sisz, disz = itemsize(e.dtype), itemsize(t.dtype)
        tr0, tc0 = _off2d(t.offsets)
        tnr, tnc = _as2d(t.local_shape)
        D = _dst_row_stride(t)
        area = 0
        boxes = []
        tr1, tc1 = tr0 + tnr, tc0 + tnc
        sdt, ddt = e.dtype, t.dtype
        strides: Dict[Tuple[tuple, tuple], int] = {}  # (sizes, strides) -> row stride
        for ch in e.chunks:
            o = ch.offsets
            cr0, cc0 = (o[0], o[1]) if len(o) == 2 else _off2d(o)
            z = ch.sizes
            cnr, cnc = (z[0], z[1]) if len(z) == 2 else _as2d(z)
            r0 = tr0 if tr0 > cr0 else cr0
            r1 = tr1 if tr1 < cr0 + cnr else cr0 + cnr
            c0 = tc0 if tc0 > cc0 else cc0
            c1 = tc1 if tc1 < cc0 + cnc else cc0 + cnc
            if r0 >= r1 or c0 >= c1:
                continue
            boxes.append((cr0, cr0 + cnr, cc0, cc0 + cnc, ch))
            area += (r1 - r0) * (c1 - c0)
            sk = (z, ch.strides)
            S = strides.get(sk)
            if S is None:
                S = strides[sk] = _chunk_row_stride(e, ch)
            fi = file_index.get(ch.file)
            if fi is None:
                fi = file_index[ch.file] = len(files)
                files.append(ch.file)
            src_off = ch.byte_offset + ((r0 - cr0) * S + (c0 - cc0)) * sisz
            dst_off = ((r0 - tr0) * D + (c0 - tc0)) * disz
            rows, width = r1 - r0, c1 - c0
            if rows == 1 or (width == S and width == D):
                ops.append(ReadOp(fi, src_off, rows * width * sisz, 1, 0, di, dst_off, 0,
                                  sdt, ddt))
            else:
                ops.append(ReadOp(fi, src_off, width * sisz, rows, S * sisz, di, dst_off,
                                  D * disz, sdt, ddt))
        _check_overlaps(e, boxes)
        if area != tnr * tnc:
            raise CoverageError(
                f"saved chunks cover {area} of the {tnr * tnc} elements of block offsets "
                f"{tuple(t.offsets)} shape {tuple(t.local_shape)}", file=ckpt.path, tensor=t.fqn)
        needed += area * sisz

    _check_files(files, ops)
    pins = getattr(getattr(ckpt, "ckpt", ckpt), "remote_meta", None)  # s3: size, ETag
    return ReadPlan(files, loaded, _merge(ops), missing, needed,
                    [file_identity(ckpt, f) for f in files], pins)


def file_identity(ckpt, path: str) -> Tuple[int, int, int, int]:
    """The identity of data file ``path`` recorded when ``ckpt`` was opened, if the reader
    recorded one, else unchecked (-1)."""
    fn = getattr(ckpt, "file_identity", None)
    if fn is None and hasattr(ckpt, "ckpt"):  # a CheckpointView
        fn = getattr(ckpt.ckpt, "file_identity", None)
    ident = fn(path) if fn is not None else None
    return tuple(int(x) for x in ident) if ident is not None else (-1, -1, -1, -1)


def _check_files(files: List[str], ops: List[ReadOp]) -> None:
    """Re-stat the files (they may have changed since the checkpoint was opened)."""
    sizes = []
    for f in files:
        try:
            sizes.append(fs.getsize(f))
        except FileNotFoundError:
            raise MissingFileError("data file does not exist", file=f) from None
        except OSError as e:  # e.g. replaced by a symlink loop since the checkpoint was opened
            raise ReadError(f"cannot stat data file ({e.strerror or e})", file=f) from None
    for op in ops:
        end = op.file_offset + (op.rows - 1) * op.src_stride + op.row_bytes
        if end > sizes[op.file_index]:
            raise TruncatedFileError(f"read [{op.file_offset}, {end}) past end of file "
                                     f"({sizes[op.file_index]} B)", file=files[op.file_index])


def _merge(ops: List[ReadOp]) -> List[ReadOp]:
    """Sort by (file, offset) and merge contiguous runs continuing each other on both sides."""
    ops = sorted(ops, key=lambda o: (o.file_index, o.file_offset))
    out: List[ReadOp] = []
    for o in ops:
        if out:
            p = out[-1]
            if (p.rows == 1 and o.rows == 1 and p.file_index == o.file_index
                    and p.dst_index == o.dst_index and p.src_dtype == o.src_dtype
                    and p.dst_dtype == o.dst_dtype
                    and p.file_offset + p.row_bytes == o.file_offset
                    and p.dst_offset + p.dst_row_bytes == o.dst_offset):
                out[-1] = ReadOp(p.file_index, p.file_offset, p.row_bytes + o.row_bytes, 1, 0,
                                 p.dst_index, p.dst_offset, 0, p.src_dtype, p.dst_dtype)
                continue
        out.append(o)
    return out


#: The former names (``metamat.load.LoadPlan``, ``metamat.load.plan_load``), kept.
LoadPlan = ReadPlan
plan_load = plan_reads
