"""Load stage: fill allocated targets from a checkpoint, reading only the bytes they need.

Two steps, kept apart so the first is testable alone:

1. :func:`plan_load` (pure Python, allocates nothing, reads no tensor data) matches targets to
   checkpoint tensors by fqn, validates everything (shapes, dtypes, coverage, byte ranges,
   destinations) and intersects each target box with each saved chunk box, emitting minimal
   :class:`ReadOp` s: one contiguous run when the intersection spans whole rows on both sides
   (TW/RW blocks, whole CW column blocks), else one strided op "rows × row_bytes" (a column
   slice of a wider chunk). Adjacent runs are merged.
2. :func:`execute_plan` hands the ops to the C++ reader (``metamat._C.read_ops``: a pread
   thread pool writing straight into the destination memory, converting fp32 <-> fp16/bf16 in
   the copy loop) in batches of :data:`BATCH_BYTES`, so a KeyboardInterrupt lands between
   batches with no reader thread left. :func:`load_targets` does both. With ``verify``,
   every block of the checkpoint the reads touch is checked against its checksum manifest
   while streaming (:mod:`metamat.fill_verify`).

Dtype policy (``dtype`` argument): ``None``/``"auto"`` (default) loads a saved dtype into the
same dtype bit-exactly and converts between float32, float16 and bfloat16 (round to nearest
even, as ``Tensor.to``) when the target's dtype differs; any other difference raises
:class:`DtypeMismatchError`. ``"exact"`` forbids conversion. A ``torch.dtype`` additionally
requires every saved tensor to have that dtype.

Only CPU destinations are supported for now; CUDA ones will go through a pinned staging ring.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .checkpoint.base import Checkpoint, Chunk, TensorEntry, itemsize
from .checkpoint.errors import (CoverageError, DestinationError,
                                DtypeMismatchError, MissingFileError, MissingTensorError,
                                OverlappingChunksError, ReadError, ShapeMismatchError,
                                TruncatedFileError, UnsupportedFormatError)
from .plan import Target

__all__ = ["ReadOp", "LoadPlan", "LoadStats", "plan_load", "execute_plan", "load_targets"]

# DType codes shared with csrc/io_reader.h (enum class DType). Keep in sync.
_RAW, _F32, _F16, _BF16 = 0, 1, 2, 3
_FLOAT_CODES = {torch.float32: _F32, torch.float16: _F16, torch.bfloat16: _BF16}


@dataclass(frozen=True)
class ReadOp:
    """``rows`` rows of ``row_bytes`` bytes: row r is read at ``file_offset + r*src_stride``
    of ``files[file_index]`` and written at byte ``dst_offset + r*dst_stride`` of
    ``targets[dst_index].tensor`` (converted from ``src_dtype`` to ``dst_dtype``).
    A contiguous run has ``rows == 1``."""

    file_index: int
    file_offset: int
    row_bytes: int
    rows: int
    src_stride: int
    dst_index: int
    dst_offset: int
    dst_stride: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype

    @property
    def src_bytes(self) -> int:
        return self.row_bytes * self.rows

    @property
    def dst_row_bytes(self) -> int:
        return self.row_bytes // itemsize(self.src_dtype) * itemsize(self.dst_dtype)


@dataclass
class LoadPlan:
    """Everything :func:`execute_plan` needs; plain data.

    Attributes:
        files: data files, indexed by ``ReadOp.file_index``.
        targets: targets that will be loaded, indexed by ``ReadOp.dst_index``.
        ops: the reads, sorted by (file, offset).
        missing: targets whose fqn the checkpoint lacks (only when not strict).
        bytes_needed: source bytes of the regions the targets need.
    """

    files: List[str]
    targets: List[Target]
    ops: List[ReadOp]
    missing: List[Target] = field(default_factory=list)
    bytes_needed: int = 0
    verified_bytes: int = 0  # set by a verifying execute_plan: checkpoint bytes checked
    reread_bytes: int = 0  # ... of which read again from the files to complete blocks


@dataclass
class LoadStats:
    """What a load did.

    Attributes:
        bytes_needed: checkpoint bytes the targets need (source dtype).
        bytes_read: bytes actually read from files (gaps of coalesced strided reads included).
        read_amplification: ``bytes_read / bytes_needed`` (1.0 when nothing was needed).
        seconds: wall time of planning plus reading.
        missing: targets not in the checkpoint (non-strict); the caller initialises them.
        loaded: number of targets filled.
        ops: number of read ops executed.
        bytes_verified: checkpoint bytes checked against the checksum manifest
            (``verify=True``: the blocks the reads touched).
        bytes_reread: of those, bytes read again from the files (block ends beyond what was
            needed, strided or converted reads).
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    read_amplification: float = 1.0
    seconds: float = 0.0
    missing: List[Target] = field(default_factory=list)
    loaded: int = 0
    ops: int = 0
    bytes_verified: int = 0
    bytes_reread: int = 0

    @property
    def gbps(self) -> float:
        """Needed bytes per second, in GB/s (1e9)."""
        return self.bytes_needed / self.seconds / 1e9 if self.seconds > 0 else 0.0


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


def _conversion_ok(saved: torch.dtype, dst: torch.dtype, policy) -> Optional[str]:
    """None if ``saved`` may be loaded into ``dst`` under ``policy``, else why not."""
    if isinstance(policy, torch.dtype) and saved != policy:
        return f"saved dtype {saved} is not the required {policy}"
    if saved == dst:
        return None
    if policy == "exact":
        return f"saved dtype {saved} differs from destination {dst} (dtype='exact')"
    if saved in _FLOAT_CODES and dst in _FLOAT_CODES:
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
    """Raise if two chunk boxes (r0, r1, c0, c1, chunk) overlap."""
    boxes = sorted(boxes, key=lambda b: (b[0], b[2]))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if b[0] >= a[1]:
                break
            if b[2] < a[3] and a[2] < b[3]:
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
    """Check ``t.tensor`` is a CPU tensor of ``t.local_shape``/``t.dtype`` with unit inner
    stride and non-overlapping rows.

    Raises:
        DestinationError: anything else (CUDA destinations are not supported yet).
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


def plan_load(targets: Sequence[Target], ckpt: Checkpoint, *, strict: bool = True,
              dtype: Union[None, str, torch.dtype] = None,
              check_destinations: bool = True) -> LoadPlan:
    """Validate the load of ``targets`` from ``ckpt`` and compute the reads.

    Args:
        targets: blocks to fill; ``fqn`` is the checkpoint key.
        ckpt: an opened checkpoint.
        strict: raise if a target's fqn is absent (else report it in ``LoadPlan.missing``).
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
        why = _conversion_ok(e.dtype, t.dtype, dtype)
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
        for ch in e.chunks:
            cr0, cc0 = _off2d(ch.offsets)
            cnr, cnc = _as2d(ch.sizes)
            r0, r1 = max(tr0, cr0), min(tr0 + tnr, cr0 + cnr)
            c0, c1 = max(tc0, cc0), min(tc0 + tnc, cc0 + cnc)
            if r0 >= r1 or c0 >= c1:
                continue
            boxes.append((cr0, cr0 + cnr, cc0, cc0 + cnc, ch))
            area += (r1 - r0) * (c1 - c0)
            S = _chunk_row_stride(e, ch)
            fi = file_index.setdefault(ch.file, len(files))
            if fi == len(files):
                files.append(ch.file)
            src_off = ch.byte_offset + ((r0 - cr0) * S + (c0 - cc0)) * sisz
            dst_off = ((r0 - tr0) * D + (c0 - tc0)) * disz
            rows, width = r1 - r0, c1 - c0
            if rows == 1 or (width == S and width == D):
                ops.append(ReadOp(fi, src_off, rows * width * sisz, 1, 0, di, dst_off, 0,
                                  e.dtype, t.dtype))
            else:
                ops.append(ReadOp(fi, src_off, width * sisz, rows, S * sisz, di, dst_off,
                                  D * disz, e.dtype, t.dtype))
        _check_overlaps(e, boxes)
        if area != tnr * tnc:
            raise CoverageError(
                f"saved chunks cover {area} of the {tnr * tnc} elements of block offsets "
                f"{tuple(t.offsets)} shape {tuple(t.local_shape)}", file=ckpt.path, tensor=t.fqn)
        needed += area * sisz

    _check_files(files, ops)
    return LoadPlan(files, loaded, _merge(ops), missing, needed)


def _check_files(files: List[str], ops: List[ReadOp]) -> None:
    """Re-stat the files (they may have changed since the checkpoint was opened)."""
    sizes = []
    for f in files:
        try:
            sizes.append(os.stat(f).st_size)
        except FileNotFoundError:
            raise MissingFileError("data file does not exist", file=f) from None
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


# ---------------------------------------------------------------------------------------------
# execution


def _op_array(plan: LoadPlan, ops: Sequence[ReadOp]) -> np.ndarray:
    """Pack ops as the (n, 9) int64 array csrc/io_reader.h's ReadOp expects."""
    arr = np.empty((len(ops), 9), dtype=np.int64)
    ptrs = [t.tensor.data_ptr() for t in plan.targets]
    for i, o in enumerate(ops):
        conv = o.src_dtype != o.dst_dtype
        arr[i] = (o.file_index, o.file_offset, o.row_bytes, o.rows, o.src_stride, o.dst_stride,
                  ptrs[o.dst_index] + o.dst_offset,
                  _FLOAT_CODES[o.src_dtype] if conv else _RAW,
                  _FLOAT_CODES[o.dst_dtype] if conv else _RAW)
    return arr


def default_io_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


#: Reads run in batches of about this many source bytes (8 reader tasks of 8 MiB): a
#: KeyboardInterrupt lands between batches (the C++ reader holds no GIL and joins its threads
#: before returning, so none is left running), progress is reported and a verifying load
#: checks the blocks each batch completed.
BATCH_BYTES = 64 << 20


def _batches(ops: Sequence[ReadOp], batch_bytes: int) -> List[List[ReadOp]]:
    """Ops grouped into consecutive batches of at most ``batch_bytes`` source bytes (a
    single op bigger than that is cut by rows, or inside its row, first)."""
    from .fill_load_staged import split_ops

    out: List[List[ReadOp]] = []
    cur: List[ReadOp] = []
    acc = 0
    for op in ops:
        if op.src_bytes > batch_bytes:
            # split_ops cuts by destination bytes; scale so the source pieces fit
            cap = max(1, batch_bytes * itemsize(op.dst_dtype) // itemsize(op.src_dtype))
            pieces = split_ops([op], cap)
        else:
            pieces = [op]
        for p in pieces:
            if cur and acc + p.src_bytes > batch_bytes:
                out.append(cur)
                cur, acc = [], 0
            cur.append(p)
            acc += p.src_bytes
    if cur:
        out.append(cur)
    return out


def execute_plan(plan: LoadPlan, *, io_threads: Optional[int] = None,
                 staging_bytes: int = 256 << 20,
                 progress: Optional[Callable[[int, int], None]] = None,
                 coalesce_gap: int = 4096, verify=None) -> int:
    """Run ``plan``'s reads into its targets' tensors; returns the bytes read from files.

    Args:
        io_threads: pread threads (default ``min(8, os.cpu_count())``).
        staging_bytes: total bounce-buffer budget (split across threads, 1-8 MiB each); used
            for dtype conversion and coalesced strided reads.
        progress: called as ``progress(bytes_done, bytes_total)`` (source bytes) between
            batches (:data:`BATCH_BYTES`).
        coalesce_gap: strided rows separated by at most this many bytes are read as one span.
        verify: None, or a :class:`metamat.checkpoint.checksum.Manifest`: every block of
            the checkpoint the reads touch is checked against it as soon as the batch that
            completes it has run (see :mod:`metamat.fill_verify`).

    Raises:
        ReadError: an I/O error or short read (destinations may be partly written).
        ChecksumMismatchError: ``verify`` and a block differs (destinations may be partly
            written).
        KeyboardInterrupt: between batches; no reader thread is left running.
        ExtensionNotBuiltError: metamat._C is missing.
    """
    from ._ext import core
    C = core()
    threads = int(io_threads) if io_threads else default_io_threads()
    if threads < 1:
        raise ValueError("io_threads must be >= 1")
    bounce = max(1 << 20, min(8 << 20, int(staging_bytes) // threads))
    total = sum(o.src_bytes for o in plan.ops)

    def run_cpp(ops) -> int:
        arr = _op_array(plan, ops)
        ok, err, failed, nread, _wrote = C.read_ops(
            plan.files, arr.ctypes.data, len(arr), threads, 8 << 20, bounce, coalesce_gap)
        if not ok:
            name = plan.targets[ops[failed].dst_index].fqn if failed >= 0 else None
            raise ReadError(err, tensor=name)
        return nread

    if verify is not None:
        from .fill_verify import execute_verified
        read, plan.verified_bytes, plan.reread_bytes = execute_verified(
            plan, verify, threads=threads, run_cpp=run_cpp, batch_bytes=BATCH_BYTES,
            progress=progress)
        return read
    done = read = 0
    for ops in _batches(plan.ops, BATCH_BYTES):
        read += run_cpp(ops)
        done += sum(o.src_bytes for o in ops)
        if progress is not None:
            progress(done, total)
    return read


def load_targets(targets: Sequence[Target], ckpt: Checkpoint, *, strict: bool = True,
                 dtype: Union[None, str, torch.dtype] = None, io_threads: Optional[int] = None,
                 staging_bytes: int = 256 << 20,
                 progress: Optional[Callable[[int, int], None]] = None,
                 staged: bool = False, verify=False) -> LoadStats:
    """Fill each target's ``tensor`` with its block of the checkpoint tensor ``target.fqn``.

    Everything is validated (see :func:`plan_load`) before the first byte is written, so a
    failed validation leaves every destination as it was.

    Args:
        targets: allocated targets (``tensor`` set, CPU or CUDA; CUDA destinations go
            through a ring of pinned staging buffers and asynchronous copies).
        ckpt: an opened checkpoint (:func:`metamat.checkpoint.open_checkpoint`).
        strict: missing fqns raise :class:`MissingTensorError`; else they are returned in
            ``LoadStats.missing`` for the caller to initialise.
        dtype: conversion policy (module docstring).
        io_threads, staging_bytes, progress: see :func:`execute_plan`.
        staged: force the staging pipeline for CPU destinations too (tests).
        verify: False; True to check every byte read against the checkpoint's checksum
            manifest (its sidecar, :func:`metamat.checkpoint.checksum.write_manifest`) while
            streaming; or an already read ``Manifest``.

    Returns:
        :class:`LoadStats`.

    Raises:
        CheckpointError subclasses (validation, or ReadError during the reads).
        MissingFileError: ``verify=True`` and no manifest (named), before any read.
        ChecksumMismatchError: ``verify`` and bytes differ from the manifest (destinations
            may be partly written).
    """
    t0 = time.perf_counter()
    manifest = resolve_manifest(ckpt, verify)
    plan = plan_load(targets, ckpt, strict=strict, dtype=dtype)
    if staged or any(t.tensor.device.type != "cpu" for t in plan.targets):
        from .fill_load_staged import execute_plan_staged  # pinned ring -> device copies
        nread = execute_plan_staged(plan, io_threads=int(io_threads or default_io_threads()),
                                    staging_bytes=staging_bytes, progress=progress,
                                    verify=manifest)
    else:
        nread = execute_plan(plan, io_threads=io_threads, staging_bytes=staging_bytes,
                             progress=progress, verify=manifest)
    secs = time.perf_counter() - t0
    return LoadStats(bytes_needed=plan.bytes_needed, bytes_read=nread,
                     read_amplification=(nread / plan.bytes_needed) if plan.bytes_needed else 1.0,
                     seconds=secs, missing=plan.missing, loaded=len(plan.targets),
                     ops=len(plan.ops), bytes_verified=plan.verified_bytes,
                     bytes_reread=plan.reread_bytes)


def resolve_manifest(ckpt: Checkpoint, verify):
    """``verify`` argument -> a Manifest or None (True: read the checkpoint's sidecar).

    Raises:
        MissingFileError: True and there is no sidecar (the message names its path).
        InvalidHeaderError: the sidecar does not parse.
    """
    if verify is None or verify is False:
        return None
    if verify is True:
        from .fill_verify import load_manifest
        return load_manifest(ckpt)
    from .checkpoint.checksum import Manifest
    if isinstance(verify, Manifest):
        return verify
    raise TypeError(f"verify must be a bool or a Manifest, got {type(verify).__name__}")
