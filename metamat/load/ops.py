"""Read ops: the unit of work of every load, and how they are packed, cut and batched.

The lowest layer of :mod:`metamat.load`: plain data and pure functions, no I/O. The planner
(:mod:`.plan`) emits :class:`ReadOp` s; the executors (:mod:`.execute` for CPU destinations,
:mod:`.staged` for device ones) cut them with :func:`split_ops`, group them with
:func:`batches` and hand them to the C++ reader as the (n, 9) int64 array of
:func:`op_array` (``csrc/include/metamat/io_reader.h``, ``struct ReadOp``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import List, Sequence

import numpy as np
import torch

from ..dtypes import CODES, CONVERTIBLE, RAW, itemsize

__all__ = ["ReadOp", "op_array", "split_ops", "batches", "default_io_threads", "BATCH_BYTES"]

_FLOAT_CODES = {d: CODES[d] for d in CONVERTIBLE}

#: Reads run in batches of about this many source bytes. Not a memory budget (CPU loads read
#: straight into place): a KeyboardInterrupt lands between batches (the C++ reader holds no
#: GIL and joins its threads before returning, so none is left running), progress is reported
#: and a verifying load checks the blocks each batch completed.
BATCH_BYTES = 64 << 20


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

    @property
    def converts(self) -> bool:
        return self.src_dtype != self.dst_dtype


def op_array(ops: Sequence[ReadOp], ptrs: Sequence[int]) -> np.ndarray:
    """Pack ``ops`` as the reader's (n, 9) int64 array; ``ptrs[op.dst_index]`` is the base
    address of each op's destination."""
    arr = np.empty((len(ops), 9), dtype=np.int64)
    for i, o in enumerate(ops):
        conv = o.converts
        arr[i] = (o.file_index, o.file_offset, o.row_bytes, o.rows, o.src_stride, o.dst_stride,
                  ptrs[o.dst_index] + o.dst_offset,
                  _FLOAT_CODES[o.src_dtype] if conv else RAW,
                  _FLOAT_CODES[o.dst_dtype] if conv else RAW)
    return arr


def _row_split(op: ReadOp, rows_per_piece: int):
    for r0 in range(0, op.rows, rows_per_piece):
        n = min(rows_per_piece, op.rows - r0)
        yield replace(op, file_offset=op.file_offset + r0 * op.src_stride, rows=n,
                      dst_offset=op.dst_offset + r0 * op.dst_stride)


def _byte_split(op: ReadOp, max_dst_bytes: int):
    """Split a single long row at element boundaries so its converted bytes fit."""
    si, di = itemsize(op.src_dtype), itemsize(op.dst_dtype)
    elems = op.row_bytes // si
    per = max(1, max_dst_bytes // di)
    for e0 in range(0, elems, per):
        n = min(per, elems - e0)
        yield replace(op, file_offset=op.file_offset + e0 * si, row_bytes=n * si, rows=1,
                      src_stride=n * si, dst_offset=op.dst_offset + e0 * di, dst_stride=n * di)


def split_ops(ops: Sequence[ReadOp], max_dst_bytes: int) -> List[ReadOp]:
    """Cut ops so none writes more than ``max_dst_bytes`` (by rows, else inside a row)."""
    out: List[ReadOp] = []
    for op in ops:
        row = op.dst_row_bytes
        if row * op.rows <= max_dst_bytes:
            out.append(op)
        elif row <= max_dst_bytes:
            out.extend(_row_split(op, max_dst_bytes // row))
        else:
            for piece in _row_split(op, 1):
                out.extend(_byte_split(piece, max_dst_bytes))
    return out


def batches(ops: Sequence[ReadOp], batch_bytes: int = BATCH_BYTES) -> List[List[ReadOp]]:
    """Ops grouped into consecutive batches of at most ``batch_bytes`` source bytes (a single
    op bigger than that is cut by rows, or inside its row, first)."""
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


MAX_DEFAULT_IO_THREADS = 16


def default_io_threads() -> int:
    """Reader threads when the caller does not say: the CPUs this process may run on, at most
    16, shared by the ranks of the node (``LOCAL_WORLD_SIZE``, which torchrun sets) unless
    each rank is bound to its own share of the machine (srun ``--cpu-bind``, numactl: the
    ranks' CPU sets together fit in the machine), which it then keeps. A CPU set the ranks
    share (a container's cpuset, a job's allocation) is divided among them.

    Page-cache reads scale past 8 threads where the cores are there: on the H100 machine (16
    cores) ``preadv`` reads 23-30 GB/s with 8 threads and 39-42 with 16 (bench/bench_stage.py),
    and a 2 GiB staged load to the GPU ran at 17.4 GB/s with 8 reader threads and 29.9 with 16
    in the same run.

    Returns:
        The number of reader threads, at least 1.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    if cpus * local <= (os.cpu_count() or 1):  # bound per rank (or one rank): its own CPUs
        local = 1
    return max(1, min(MAX_DEFAULT_IO_THREADS, cpus // local))
