"""Fill stage (load) for device destinations: read into a ring of staging buffers, copy on.

The C++ reader writes each chunk of reads into one of ``ring`` host buffers (pinned when the
destinations are on CUDA), then the chunk is copied to its destinations asynchronously on a
copy stream; an event per buffer says when it may be reused, so reading chunk k+1 overlaps
copying chunk k. dtype conversion happens in the reader's copy loop on the host. The buffers
are allocated once per call, reused, and released on every exit path (the caller's tensors
only are written). On CPU destinations the same pipeline runs with ordinary buffers (used by
the tests to check the chunking; plain CPU loads read straight into place instead).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .checkpoint.base import itemsize
from .checkpoint.errors import ReadError

__all__ = ["execute_plan_staged", "split_ops"]


def _row_split(op, rows_per_piece: int):
    for r0 in range(0, op.rows, rows_per_piece):
        n = min(rows_per_piece, op.rows - r0)
        yield replace(op, file_offset=op.file_offset + r0 * op.src_stride, rows=n,
                      dst_offset=op.dst_offset + r0 * op.dst_stride)


def _byte_split(op, max_dst_bytes: int):
    """Split a single long row at element boundaries so its converted bytes fit."""
    si, di = itemsize(op.src_dtype), itemsize(op.dst_dtype)
    elems = op.row_bytes // si
    per = max(1, max_dst_bytes // di)
    for e0 in range(0, elems, per):
        n = min(per, elems - e0)
        yield replace(op, file_offset=op.file_offset + e0 * si, row_bytes=n * si, rows=1,
                      src_stride=n * si, dst_offset=op.dst_offset + e0 * di, dst_stride=n * di)


def split_ops(ops: Sequence, max_dst_bytes: int) -> List:
    """Cut ops so none writes more than ``max_dst_bytes`` (by rows, else inside a row)."""
    out = []
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


def _chunks(ops: Sequence, cap: int) -> List[List[Tuple[object, int]]]:
    """Group ops into chunks of at most ``cap`` staged bytes: [(op, offset in buffer)]."""
    chunks, cur, used = [], [], 0
    for op in ops:
        n = op.dst_row_bytes * op.rows
        if cur and used + n > cap:
            chunks.append(cur)
            cur, used = [], 0
        cur.append((op, used))
        used += (n + 63) & ~63  # keep each op's staging 64-byte aligned
    if cur:
        chunks.append(cur)
    return chunks


def _dst_view(t: torch.Tensor, op) -> torch.Tensor:
    """The bytes of ``t`` that ``op`` writes, as a (rows, row bytes) uint8 view."""
    st = t.untyped_storage()
    base = t.storage_offset() * t.element_size() + op.dst_offset
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
    return u8.as_strided((op.rows, op.dst_row_bytes), (op.dst_stride, 1), base)


def execute_plan_staged(plan, *, io_threads: int, staging_bytes: int = 256 << 20, ring: int = 2,
                        progress: Optional[Callable[[int, int], None]] = None,
                        coalesce_gap: int = 4096, verify=None) -> int:
    """Run ``plan`` (see ``metamat.fill_load``) through staging buffers; returns bytes read.

    Args:
        staging_bytes: host memory for the ring (split into ``ring`` buffers).
        ring: number of buffers (2: read one while the other is copied).
        verify: None or a checksum ``Manifest``: each staged chunk is checked (its bytes
            hashed in the staging buffer, the rest of the blocks it touches re-read from the
            files) before it is copied to the destinations.

    Raises:
        ReadError: an I/O error (destinations may be partly written).
        ChecksumMismatchError: ``verify`` and a block differs.
    """
    from ._ext import core
    from .fill_load import _op_array, LoadPlan

    if ring < 1:
        raise ValueError("ring must be >= 1")
    cap = max(1 << 16, int(staging_bytes) // ring)
    ops = split_ops(plan.ops, cap)
    devices = {t.tensor.device for t in plan.targets}
    cuda = any(d.type == "cuda" for d in devices)
    pin = cuda and torch.cuda.is_available()
    total = sum(o.src_bytes for o in ops)
    buffers = [torch.empty(cap, dtype=torch.uint8, pin_memory=pin) for _ in range(ring)]
    stream = torch.cuda.Stream() if cuda else None
    events: List[Optional[torch.cuda.Event]] = [None] * ring
    C = core()
    read = done = 0
    checker = None
    if verify is not None:
        from .fill_verify import StreamVerifier
        checker = StreamVerifier(verify, plan.files)  # buffers are reused: verify per chunk
    try:
        for k, chunk in enumerate(_chunks(ops, cap)):
            b = k % ring
            if events[b] is not None:
                events[b].synchronize()  # its previous copies have left the buffer
            buf = buffers[b]
            staged = [replace(op, dst_index=0, dst_offset=off, dst_stride=op.dst_row_bytes)
                      for op, off in chunk]
            arr = _op_array(LoadPlan(plan.files, [_Dst(buf)], []), staged)
            ok, err, failed, nread, _ = C.read_ops(plan.files, arr.ctypes.data, len(arr),
                                                   io_threads, 8 << 20, 8 << 20, coalesce_gap)
            read += nread
            if not ok:
                name = plan.targets[chunk[failed][0].dst_index].fqn if failed >= 0 else None
                raise ReadError(err, tensor=name)
            if checker is not None:
                checker.after_batch(k, staged, [buf.data_ptr()])
            ctx = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
            with ctx:
                for op, off in chunk:
                    n = op.dst_row_bytes * op.rows
                    src = buf[off:off + n].view(op.rows, op.dst_row_bytes)
                    _dst_view(plan.targets[op.dst_index].tensor, op).copy_(src, non_blocking=cuda)
                if cuda:
                    events[b] = torch.cuda.Event()
                    events[b].record(stream)
            done += sum(op.src_bytes for op, _ in chunk)
            if progress is not None:
                progress(done, total)
        if checker is not None:
            checker.finish()
            plan.verified_bytes = checker.bytes_hashed
            plan.reread_bytes = checker.bytes_reread
    finally:
        if checker is not None:
            checker.close()
        if cuda:  # every copy finished before the buffers go back to the allocator
            for e in events:
                if e is not None:
                    e.synchronize()
            torch.cuda.current_stream().wait_stream(stream)
    return read


class _Dst:
    """A stand-in Target whose tensor is the staging buffer (for ``_op_array``)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.tensor = buf
