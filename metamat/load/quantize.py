"""Quantized loads: float table rows from a checkpoint into fbgemm's inference TBE rows.

A quantized table's row needs its whole float row at once (the scale and bias come from the
row's minimum and maximum), and the float table must never exist in memory. So its rows are
read in pieces of a bounded float32 scratch buffer (the reader converts fp16/bf16 to fp32 in
its copy loop) and the C++ core (``_C.quantize_rows``, csrc/include/metamat/quant_rowwise.h) writes
each piece's quantized rows, with their scale/bias, straight into the TBE's storage, on the
reader's threads' budget. The scratch buffer is part of ``staging_bytes``; host memory stays
the quantized bytes plus the staging budget.

The layout and the values are fbgemm's (``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``, the
op TorchRec's ``quantize_embeddings`` / ``from_float`` call), measured on fbgemm-gpu-cpu 1.8
(docs/QUANT.md): INT8/INT4/INT2 rows are ``[scale fp16][bias fp16][packed data]`` (fbgemm's
``reverse_qparam``: data first) padded with zeros to the TBE's row alignment; FP16/FP32 rows
are the converted data, padded likewise. :func:`quantize_reference` is the slow NumPy
reference of the core's kernel.

Layers: this module sits beside :mod:`.plan`/:mod:`.execute` (it plans reads with
:func:`~metamat.load.plan.plan_reads` and runs them with :func:`metamat.load.execute`); the
model adapter (:mod:`metamat.models.torchrec.quant_part`) builds the jobs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..budget import groups_within
from ..checkpoint.errors import DtypeMismatchError
from ..plan import Target
from .quantize_device import DeviceSink, device_quantizable, quant_on

__all__ = ["KINDS", "INT_KINDS", "QuantizedCheckpointError", "refuse_quantized", "unpadded_row_bytes",
           "padded_row_bytes", "quantize_reference", "QuantOut", "QuantJob", "QuantReads",
           "quantize_into", "DeviceSink", "quant_on", "plan_quant_reads", "rows_per_piece", "scratch_bytes_for", "SCRATCH_MAX", "PIECE_BYTES"]

#: fbgemm ``SparseType`` value -> the core's kind code (the bit width).
KINDS = {"int8": 8, "int4": 4, "int2": 2, "fp16": 16, "fp32": 32}
INT_KINDS = (8, 4, 2)
#: The scratch buffer of float rows is at most this (and half of ``staging_bytes``): pieces of
#: 16 MiB stay in this machine's L3 between the read and the quantize pass
#: (bench/bench_quant.py measured 16-64 MiB alike, docs/QUANT.md).
SCRATCH_MAX = 16 << 20
#: Rows are planned in pieces of about this many float32 bytes (a round of the scratch buffer
#: reads as many pieces as fit).
PIECE_BYTES = 4 << 20


class QuantizedCheckpointError(DtypeMismatchError):
    """A quantized table in the checkpoint (uint8 rows with a scale and bias) for a float
    tensor of the model: metamat quantizes while loading, it does not dequantize."""


def refuse_quantized(targets: Sequence[Target], keys, view_keys, path: str) -> None:
    """Refuse a quantized table's rows (uint8, TorchRec's quantized ``state_dict``) for a
    float tensor of the model, before anything is allocated.

    Args:
        targets: the model's targets to load (fqn -> ``view_keys`` -> checkpoint key).
        keys: the checkpoint's tensors (key -> entry with ``dtype``, ``global_shape``).

    Raises:
        QuantizedCheckpointError: naming the tensor, what the checkpoint holds and what to do.
    """
    for t in targets:
        ck = view_keys.get(t.fqn)
        e = keys.get(ck) if ck is not None else None
        if e is None or e.dtype != torch.uint8 or not t.dtype.is_floating_point \
                or len(e.global_shape) != 2 or not ck.endswith("weight"):
            continue
        split = ck[: -len("weight")] + "weight_qscale" in keys
        raise QuantizedCheckpointError(
            f"the checkpoint holds this table quantized (uint8 rows {tuple(e.global_shape)}"
            + (" with weight_qscale/weight_qbias" if split else "") + f") and the model's "
            f"tensor is {t.dtype}: metamat quantizes float (training) checkpoints into "
            "quantized models while loading; it does not dequantize. Load a float checkpoint "
            "into this model, or build the quantized model (torchrec.quant.embedding_modules, "
            "quantize_inference_model) on meta and load this checkpoint into it",
            file=path, tensor=t.fqn)


def unpadded_row_bytes(kind: int, cols: int) -> int:
    """Bytes of one TBE row of ``cols`` elements before padding (fbgemm's
    ``unpadded_row_size_in_bytes`` with 4 bytes of scale/bias)."""
    if kind in INT_KINDS:
        return cols * kind // 8 + 4
    return cols * kind // 8


def padded_row_bytes(kind: int, cols: int, alignment: int) -> int:
    """fbgemm's ``rounded_row_size_in_bytes``: the row padded to ``alignment``."""
    r = unpadded_row_bytes(kind, cols)
    return (r + alignment - 1) // alignment * alignment


def _f16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def quantize_reference(x: np.ndarray, kind: int, *, sb_last: bool = False) -> np.ndarray:
    """The core's row conversion, in NumPy (slow, for tests): float32 rows ``x`` (rows, cols)
    -> uint8 (rows, :func:`unpadded_row_bytes`) in the TBE's layout.

    INT-N follows fbgemm's op: min/max in 8 lanes over whole chunks of 8, lanes folded in
    order, then the tail; a zero minimum is the row's first zero (its sign is fbgemm 1.9's: the
    first of equal minima); bias = fp16(min); scale = fp16((max - fp16(min)) / (2^b - 1)) (1
    when the range is 0, the scale rounds to 0 or its inverse is infinite);
    q = clamp(rint((x - min) * (1/scale))).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    if kind == 32:
        return x.view(np.uint8).reshape(rows, 4 * cols).copy()
    if kind == 16:
        return x.astype(np.float16).view(np.uint8).reshape(rows, 2 * cols).copy()
    if kind not in INT_KINDS or cols % (8 // kind):
        raise ValueError(f"kind {kind} with {cols} columns")
    out = np.zeros((rows, unpadded_row_bytes(kind, cols)), dtype=np.uint8)
    epb, maxq = 8 // kind, (1 << kind) - 1
    flt_max = np.float32(np.finfo(np.float32).max)
    for r in range(rows):
        v = x[r]
        lmin, lmax = [flt_max] * 8, [-flt_max] * 8
        whole = cols // 8 * 8
        for c in range(whole):
            j = c % 8
            lmin[j] = lmin[j] if lmin[j] < v[c] else v[c]
            lmax[j] = lmax[j] if lmax[j] > v[c] else v[c]
        mn, mx = flt_max, -flt_max
        for j in range(8):
            mn = lmin[j] if lmin[j] < mn else mn
            mx = lmax[j] if mx < lmax[j] else mx
        for c in range(whole, cols):
            mn = v[c] if v[c] < mn else mn
            mx = v[c] if mx < v[c] else mx
        if mn == 0:
            mn = v[np.flatnonzero(v == 0)[0]]
        bias = np.float32(mn).astype(np.float16)
        mn = np.float32(bias)
        rng = np.float32(np.float32(mx) - mn)
        scale = np.float32(1.0) if rng == 0 else np.float32(rng / np.float32(maxq))
        scale = np.float32(np.float16(scale))
        if scale == 0:
            scale = np.float32(1.0)
        with np.errstate(divide="ignore", over="ignore"):
            inv = np.float32(np.float32(1.0) / scale)
        if np.isinf(inv):
            scale, inv = np.float32(1.0), np.float32(1.0)
        with np.errstate(invalid="ignore", over="ignore"):
            q = np.rint((v - mn) * inv)  # float32 ops, round half to even
        q = np.clip(np.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0), 0, maxq).astype(np.uint32)
        packed = np.zeros(cols // epb, dtype=np.uint32)
        for k in range(epb):
            packed |= q[k::epb] << (k * kind)
        data = packed.astype(np.uint8)
        sb = np.array([_f16_bits(scale), bias.view(np.uint16)], dtype=np.uint16).view(np.uint8)
        out[r] = np.concatenate([data, sb]) if sb_last else np.concatenate([sb, data])
    return out


@dataclass
class QuantOut:
    """Where one block of a table's rows lands: columns ``[col0, col0 + cols)`` of the float
    rows, as ``kind`` rows at byte ``offset + i * stride`` of storage ``storage`` (row ``i`` of
    the job). ``base``: the allocated storage as a host uint8 tensor (set when bound)."""

    col0: int
    cols: int
    kind: int
    storage: int
    offset: int
    stride: int
    sb_last: bool = False
    base: Optional[torch.Tensor] = field(default=None, repr=False)
    device_memory: bool = False  # base is device memory: rows go through a host bounce


@dataclass
class QuantJob:
    """Rows ``[row0, row0 + rows)`` of the float table ``fqn`` (global ``(rows, cols)`` shape
    ``global_shape``), quantized into every destination of ``outs`` (a column-wise sharded
    table's shards share one job: their rows' scale/bias come from the whole row).

    ``key``/``dist``/``init_fn``: the table's RNG key and init, for rows no checkpoint gives.
    ``targets``: the model's targets (report) this job writes."""

    fqn: str
    key: str
    global_shape: Tuple[int, int]
    row0: int
    rows: int
    outs: List[QuantOut]
    dist: object = None
    init_fn: object = None
    targets: List[Target] = field(default_factory=list, repr=False)

    @property
    def cols(self) -> int:
        return int(self.global_shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes it writes (data and scale/bias, no padding)."""
        return sum(self.rows * unpadded_row_bytes(o.kind, o.cols) for o in self.outs)


def quantize_into(src: torch.Tensor, job: QuantJob, row: int, *, threads: int = 1,
                  isa: str = "", sink: Optional[DeviceSink] = None) -> None:
    """Write ``src`` (float32 (n, cols), row stride ``src.stride(0)``), rows ``row`` ..
    ``row + n`` of ``job``, into every bound destination of ``job`` (destinations in device
    memory through ``sink``'s bounce buffers).

    Raises:
        ValueError: ``src`` is not float32 CPU rows of ``job.cols`` with unit inner stride,
            a destination is not bound, or device memory without a ``sink``.
    """
    from .._ext import core

    n = src.shape[0]
    if src.dtype != torch.float32 or src.device.type != "cpu" or src.dim() != 2 \
            or src.shape[1] != job.cols or (job.cols > 1 and src.stride(1) != 1):
        raise ValueError(f"{job.fqn}: quantize source must be CPU float32 (n, {job.cols})")
    if row < 0 or row + n > job.rows:
        raise ValueError(f"{job.fqn}: rows {row}..{row + n} outside the job's {job.rows}")
    if n == 0:
        return
    arr = np.empty((len(job.outs), 6), dtype=np.int64)
    sends = []
    on_device = [o for o in job.outs if o.device_memory and sink is not None and
                 sink.on_device and device_quantizable(o.kind, job.cols, o.col0, o.cols)]
    quantized_there = {id(o) for o in on_device}
    for i, o in enumerate(job.outs):
        if o.base is None:
            raise ValueError(f"{job.fqn}: destination not bound")
        start = o.offset + row * o.stride
        end = o.offset + (row + n - 1) * o.stride + unpadded_row_bytes(o.kind, o.cols)
        if end > o.base.numel():
            raise ValueError(f"{job.fqn}: destination rows past the end of their storage")
        if o.device_memory:
            if sink is None:
                raise ValueError(f"{job.fqn}: device memory needs a DeviceSink")
            if id(o) in quantized_there:
                continue
            host = sink.buffer(n * o.stride)
            sends.append((host, o.base[start:start + n * o.stride]))
            addr = host.data_ptr()
        else:
            addr = o.base.data_ptr() + start
        arr[i] = (o.col0, o.cols, addr, o.stride, o.kind, int(o.sb_last))
        if o.device_memory:  # one bounce buffer per device destination at a time
            core().quantize_rows(src.data_ptr(), n, job.cols, src.stride(0) if n > 1 else job.cols,
                                 arr[i:i + 1].ctypes.data, 1, threads, isa)
            sink.send(*sends.pop())
    if on_device:  # METAMAT_QUANT_ON=device: fbgemm's op on the device
        sink.quantize_on_device(src, row, on_device)
    host_rows = [i for i, o in enumerate(job.outs) if not o.device_memory]
    if host_rows:
        a = np.ascontiguousarray(arr[host_rows])
        core().quantize_rows(src.data_ptr(), n, job.cols, src.stride(0) if n > 1 else job.cols,
                             a.ctypes.data, len(a), threads, isa)


def _piece_rows(cols: int, piece_bytes: int) -> int:
    return max(1, piece_bytes // (4 * cols))


def scratch_bytes_for(staging_bytes: int, widest_piece: int) -> int:
    """Bytes of the float scratch buffer of a load with ``staging_bytes``: half of it, at most
    :data:`SCRATCH_MAX`, and at least the widest piece (one row when rows are wide)."""
    return max(widest_piece, min(SCRATCH_MAX, int(staging_bytes) // 2) // 4 * 4)


@dataclass
class QuantReads:
    """The quantized loads of one call, planned (no memory touched): float32 pieces of the
    jobs' rows (``pieces[i]`` is rows of ``jobs[owner[i]]`` from job row ``start[i]``) and the
    read plan filling them."""

    jobs: List[QuantJob]
    pieces: List[Target]
    owner: List[int]
    start: List[int]
    plan: object = None  # a ReadPlan
    widest: int = 0  # bytes of the widest piece

    @property
    def src_bytes(self) -> int:
        return self.plan.src_bytes if self.plan is not None else 0

    @property
    def bytes_needed(self) -> int:
        return self.plan.bytes_needed if self.plan is not None else 0

    def execute(self, *, io_threads: Optional[int] = None, staging_bytes: int = 256 << 20,
                progress: Optional[Callable[[int, int], None]] = None, verify=None,
                io: str = "auto"):
        """Read the pieces into the scratch buffer (:func:`scratch_bytes_for`), as many as fit
        per round, then quantize them into place; the reader gets the rest of
        ``staging_bytes``. Returns the reads' :class:`~metamat.load.execute.Executed`.

        Raises:
            ReadError, ChecksumMismatchError: destinations may be partly written.
        """
        from . import execute
        from .execute import Executed
        from .ops import default_io_threads

        out = Executed()
        if self.plan is None or not self.pieces:
            return out
        threads = default_io_threads() if io_threads is None else io_threads
        scratch_bytes = scratch_bytes_for(staging_bytes, self.widest)
        scratch = torch.empty(scratch_bytes // 4, dtype=torch.float32)
        reader_bytes = max(int(staging_bytes) - scratch_bytes, threads * (64 << 10))
        sink = DeviceSink(on_device=quant_on() == "device")
        index = {id(t): i for i, t in enumerate(self.pieces)}
        order = [index[id(t)] for t in self.plan.targets]  # plan target k is piece order[k]
        total, done = self.plan.src_bytes, 0
        rounds = groups_within([self.pieces[i].local_shape[0] * self.pieces[i].local_shape[1]
                                for i in order], scratch.numel())
        for keep in rounds:
            pos = 0
            for k in keep:
                t = self.plan.targets[k]
                n = t.local_shape[0] * t.local_shape[1]
                t.tensor = scratch[pos:pos + n].view(t.local_shape)
                pos += n
            sub = self.plan.subplan(keep)
            cb = None if progress is None else (lambda d, _t, b=done: progress(b + d, total))
            r = execute(sub, io_threads=threads, staging_bytes=reader_bytes, progress=cb,
                        verify=verify, io=io)
            out.merge(r)
            done += sub.src_bytes
            for k in keep:
                t = self.plan.targets[k]
                i = order[k]
                quantize_into(t.tensor, self.jobs[self.owner[i]], self.start[i],
                              threads=threads, sink=sink)
                t.tensor = None
        sink.finish()  # the scratch may be reused: every copy out of the bounce buffers done
        return out


def plan_quant_reads(jobs: Sequence[QuantJob], view, *, dtype=None) -> QuantReads:
    """Plan the reads of ``jobs`` from checkpoint ``view`` (keys are the jobs' fqns): pieces
    of whole float rows of about :data:`PIECE_BYTES` (one row at least). Validates everything
    (shapes, dtypes, coverage, files) before anything is read, as
    :func:`~metamat.load.plan.plan_reads`.

    Raises:
        CheckpointError subclasses (:func:`~metamat.load.plan.plan_reads`).
    """
    from .plan import plan_reads

    pieces, owner, start = [], [], []
    widest = 0
    for j, job in enumerate(jobs):
        per = _piece_rows(job.cols, PIECE_BYTES)
        widest = max(widest, min(per, job.rows) * job.cols * 4)
        for r in range(0, job.rows, per):
            n = min(per, job.rows - r)
            pieces.append(Target(job.fqn, job.key, tuple(job.global_shape), (job.row0 + r, 0),
                                 (n, job.cols), torch.float32))
            owner.append(j)
            start.append(r)
    out = QuantReads(list(jobs), pieces, owner, start, widest=widest)
    if pieces:
        policy = dtype if isinstance(dtype, torch.dtype) else None
        out.plan = plan_reads(pieces, view, strict=True, dtype=policy, check_destinations=False)
    return out


def rows_per_piece(cols: int) -> int:
    """Rows of a ``cols``-wide table per piece (:data:`PIECE_BYTES`)."""
    return _piece_rows(cols, PIECE_BYTES)
