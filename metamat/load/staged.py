"""Execute a load plan for device destinations: read into a ring of staging buffers, copy on.

The C++ reader writes each chunk of reads into one of ``budget.ring`` host buffers (pinned
when the destinations are on CUDA), then the chunk is copied to its destinations
asynchronously on a copy stream of the destination's device; an event per buffer says when it
may be reused, so reading chunk k+1 overlaps copying chunk k. dtype conversion happens in the
reader's copy loop on the host. Buffers are allocated once per call, reused, and released on
every exit path (only the caller's tensors are written).

Stream order: the copy stream first waits for the destination device's current stream (the
caller may still be using the memory being overwritten), and the current stream waits for the
copy stream at the end (work queued after the load sees the loaded bytes).

On host destinations the same pipeline runs with ordinary buffers (the tests use it to check
the chunking; plain host loads read straight into place, :mod:`.execute`).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..budget import StagingBudget
from .execute import Executed, run_reader
from .ops import ReadOp, split_ops
from .plan import LoadPlan

__all__ = ["execute_plan_staged"]


def _chunks(ops: Sequence[ReadOp], cap: int) -> List[List[Tuple[ReadOp, int]]]:
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


def _dst_view(t: torch.Tensor, op: ReadOp) -> torch.Tensor:
    """The bytes of ``t`` that ``op`` writes, as a (rows, row bytes) uint8 view."""
    st = t.untyped_storage()
    base = t.storage_offset() * t.element_size() + op.dst_offset
    u8 = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
    return u8.as_strided((op.rows, op.dst_row_bytes), (op.dst_stride, 1), base)


class _Copier:
    """Async copies to one CUDA device on its own stream, ordered after the caller's work
    on that device's current stream (or synchronous copies for host destinations)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.stream = None
        if self.cuda:
            with torch.cuda.device(device):
                self.stream = torch.cuda.Stream(device)
                self.stream.wait_stream(torch.cuda.current_stream(device))

    def context(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def event(self) -> Optional["torch.cuda.Event"]:
        if not self.cuda:
            return None
        e = torch.cuda.Event()
        e.record(self.stream)
        return e

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def execute_plan_staged(plan: LoadPlan, budget: StagingBudget, *,
                        progress: Optional[Callable[[int, int], None]] = None,
                        verify=None, io: str = "auto") -> Executed:
    """Run ``plan`` through ``budget.ring`` staging buffers of ``budget.ring_bytes``.

    Args:
        plan: a validated plan whose targets hold allocated tensors (any device).
        budget: a staged split (``StagingBudget.split(..., staged=True)``).
        progress: called as ``progress(bytes_done, bytes_total)`` after each chunk.
        verify: None or a checksum ``Manifest``: the reader hashes each staged chunk's
            blocks as it reads them (block ends no op needs are read only for the hash),
            before the chunk is copied to the destinations.
        io: ``"auto"``, ``"buffered"`` or ``"direct"``.

    Returns:
        :class:`~metamat.load.execute.Executed`.

    Raises:
        ReadError: an I/O error (destinations may be partly written).
        ChecksumMismatchError: ``verify`` and a block differs.
    """
    if budget.ring < 1:
        raise ValueError("execute_plan_staged needs a staged budget (ring >= 1)")
    cap = budget.ring_bytes
    ops = split_ops(plan.ops, cap)
    devices = {t.tensor.device for t in plan.targets}
    pin = any(d.type == "cuda" for d in devices) and torch.cuda.is_available()
    total = sum(o.src_bytes for o in ops)
    buffers = [torch.empty(cap, dtype=torch.uint8, pin_memory=pin) for _ in range(budget.ring)]
    copiers: Dict[torch.device, _Copier] = {d: _Copier(d) for d in devices}
    events: List[List] = [[] for _ in range(budget.ring)]
    out = Executed()
    done = 0
    index = None
    if verify is not None:
        from .verify import BlockIndex
        index = BlockIndex(verify, plan.files)
    try:
        for k, chunk in enumerate(_chunks(ops, cap)):
            b = k % budget.ring
            for e in events[b]:
                e.synchronize()  # the buffer's previous copies have left it
            events[b] = []
            buf = buffers[b]
            staged = [replace(op, dst_index=0, dst_offset=off, dst_stride=op.dst_row_bytes)
                      for op, off in chunk]
            out.add(run_reader(plan, staged, [buf.data_ptr()], budget,
                               lambda i, chunk=chunk: plan.targets[chunk[i][0].dst_index].fqn,
                               io=io, blocks=index))
            by_dev: Dict[torch.device, List[Tuple[ReadOp, int]]] = {}
            for op, off in chunk:
                by_dev.setdefault(plan.targets[op.dst_index].tensor.device, []).append((op, off))
            for dev, items in by_dev.items():
                cp = copiers[dev]
                with cp.context():
                    for op, off in items:
                        n = op.dst_row_bytes * op.rows
                        src = buf[off:off + n].view(op.rows, op.dst_row_bytes)
                        _dst_view(plan.targets[op.dst_index].tensor, op).copy_(
                            src, non_blocking=cp.cuda)
                    ev = cp.event()
                    if ev is not None:
                        events[b].append(ev)
            done += sum(op.src_bytes for op, _ in chunk)
            if progress is not None:
                progress(done, total)
    finally:
        # every copy has finished before the buffers go back to the allocator
        for evs in events:
            for e in evs:
                e.synchronize()
        for cp in copiers.values():
            cp.finish()
    return out
