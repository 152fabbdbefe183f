"""Execute a load plan for device destinations through the C++ staging pipeline.

``metamat._C.StagePipeline`` (``csrc/include/metamat/stage.h``) owns ``budget.ring`` host buffers of
``budget.ring_bytes`` (page-locked with ``cudaHostAlloc`` when a destination is on CUDA; taken
from, and given back to, a cache of one ring per process: :func:`release_staging_memory`) and one
copy sink per destination device. For each chunk of reads it waits for the buffer's previous
copies (an event per buffer), reads the chunk into it with the ordinary C++ reader (threads,
direct or buffered I/O, XXH3 verification, fp32 -> fp16/bf16 conversion in the host copy loop,
so the conversion halves the bytes crossing PCIe), then queues one ``cudaMemcpyAsync`` (or
``cudaMemcpy2DAsync`` for strided rows) per op on its device's copy stream and records the
buffer's event: reading chunk k+1 overlaps copying chunk k. No per-op Python work.

Stream order: each CUDA sink's copy stream first waits for the destination device's current
stream (the caller may still be using the memory being overwritten), and that stream waits for
the copy stream when the pipeline is closed (work queued after the load sees the loaded bytes).
Every CUDA call runs with the destination's device current (restored after).

Host destinations (the tests force them through here to check the pipeline on CPU) use the host
sink: the same pipeline with memcpy on a sink thread and sequence-number events. Buffers and
sink threads are released on every exit path (``close()`` in a ``finally``).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from .._ext import core
from ..budget import StagingBudget
from ..checkpoint.errors import ReadError
from .execute import IO_MODES, TASK_BYTES, Executed
from . import ops as _ops
from .ops import batches, op_array
from .plan import ReadPlan
from .verify import block_index

__all__ = ["execute_plan_staged", "release_staging_memory"]


def release_staging_memory() -> int:
    """Free the staging ring metamat keeps between staged loads; returns the bytes freed.

    Page-locking host memory is slow (~2.4 GiB/s measured on an H100 machine), so when a
    staged load ends its ring is kept (at most one ring, the last one's) for the next load in
    the process instead of being freed, as torch keeps its pinned blocks. That ring is held
    outside any load's ``staging_bytes`` between loads (and, while the next load allocates a
    ring of another size, beside it). Call this to give the memory back earlier;
    ``METAMAT_STAGING_CACHE=0`` turns the cache off. Safe at any time: a load in progress keeps
    its ring until it ends (then the ring is cached again).

    Returns:
        The bytes of page-locked (or host) memory given back; 0 when no ring was kept.
    """
    return int(core().stage_free_cached())


def _sink(device: torch.device, options: Optional[dict]) -> dict:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return {"kind": "cuda", "device": idx,
                "stream": torch.cuda.current_stream(idx).cuda_stream}
    if device.type != "cpu":
        raise ValueError(f"staged loads copy to CPU or CUDA tensors, not {device.type}")
    return {"kind": "host", **(options or {})}


# Ring buffer bytes per reader thread for CUDA destinations: enough for every thread to read a
# share of each chunk (the reader's 2 MiB task floor, twice), small enough that page-locking
# the ring stays a small part of a first load. On the H100 machine (2 GiB, 8 threads, ring
# reused) rings of 2 x 24 and 2 x 48 MiB loaded at 25.8 and 26.6 GB/s and 2 x 96 MiB (the
# whole default budget, filled 64 MiB at a time: chunks never span two batches) at 23.2,
# while a first call spent 29, 49 and 116 ms creating the pipeline (mostly page-locking).
RING_BYTES_PER_THREAD = 4 << 20


def ring_shape(budget: StagingBudget, need: int, cuda: bool):
    """(buffers, bytes each) of the ring for a load staging ``need`` bytes: the budget's
    split, capped at ``RING_BYTES_PER_THREAD`` per reader thread for CUDA destinations, and no
    more than the load needs (a small load allocates, and page-locks, only what it stages)."""
    cap = budget.ring_bytes
    if cuda:
        cap = min(cap, max(RING_BYTES_PER_THREAD * budget.threads, 64 << 10))
    ring_bytes = max(64, min(cap, need))
    return (budget.ring if need > ring_bytes else 1), ring_bytes


def execute_plan_staged(plan: ReadPlan, budget: StagingBudget, *,
                        progress: Optional[Callable[[int, int], None]] = None,
                        verify=None, io: str = "auto",
                        _host_sink: Optional[dict] = None) -> Executed:
    """Run ``plan`` through ``budget.ring`` staging buffers of ``budget.ring_bytes``.

    Args:
        plan: a validated plan whose targets hold allocated tensors (CPU or CUDA).
        budget: a staged split (``StagingBudget.split(..., staged=True)``).
        progress: called as ``progress(bytes_done, bytes_total)`` after each batch of
            :data:`~metamat.load.ops.BATCH_BYTES`.
        verify: None or a checksum ``Manifest``: the reader hashes each staged chunk's
            blocks as it reads them (block ends no op needs are read only for the hash),
            before the chunk is copied to the destinations.
        io: ``"auto"``, ``"buffered"`` or ``"direct"``.
        _host_sink: tests: extra options of the host sink (``delay_us``, ``fail_copy_at``).

    Returns:
        :class:`~metamat.load.execute.Executed`.

    Raises:
        ReadError: an I/O error (destinations may be partly written).
        ChecksumMismatchError: ``verify`` and a block differs.
        RuntimeError: CUDA destinations and a build without the CUDA backend, or a copy
            failed (``metamat._C.CoreError``).
    """
    if budget.ring < 1:
        raise ValueError("execute_plan_staged needs a staged budget (ring >= 1)")
    if io not in IO_MODES:
        raise ValueError(f"io must be one of {IO_MODES}, got {io!r}")
    C = core()
    devices: List[torch.device] = []
    for t in plan.targets:
        if t.tensor.device not in devices:
            devices.append(t.tensor.device)
    if any(d.type == "cuda" for d in devices) and not C.cuda_compiled():
        raise RuntimeError("metamat was built without its CUDA backend; CUDA destinations "
                           "need it (rebuild with METAMAT_CUDA=1 on a machine with nvcc)")
    sink_index: Dict[torch.device, int] = {d: i for i, d in enumerate(devices)}
    sink_of_target = [sink_index[t.tensor.device] for t in plan.targets]
    ptrs = [t.tensor.data_ptr() for t in plan.targets]
    index = block_index(verify, plan.files)
    total = plan.src_bytes
    done = 0
    out = Executed()
    need = sum(o.dst_row_bytes * o.rows + 64 for o in plan.ops)
    ring, ring_bytes = ring_shape(budget, need, any(d.type == "cuda" for d in devices))
    t0 = time.perf_counter()
    pipe = C.StagePipeline(ring, ring_bytes, [_sink(d, _host_sink) for d in devices])
    out.staging_seconds = time.perf_counter() - t0
    try:
        for ops in batches(plan.ops, _ops.BATCH_BYTES):  # read at call time (tests patch it)
            arr = op_array(ops, ptrs)
            sinks = np.array([sink_of_target[o.dst_index] for o in ops], dtype=np.int64)
            kw = {}
            if index is not None:
                vb = index.blocks(ops)
                kw = {"verify_addr": vb.ctypes.data, "verify_count": len(vb)}
            r = pipe.run(list(plan.files), arr.ctypes.data, sinks.ctypes.data, len(arr),
                         threads=budget.threads, task_bytes=TASK_BYTES,
                         bounce_bytes=budget.bounce_bytes, identities=plan.identities, io=io,
                         **kw)
            if not r["ok"]:
                if r.get("mismatch") is not None and index is not None:
                    raise index.mismatch_error(r["mismatch"])
                failed = r["failed_op"]
                raise ReadError(r["error"],
                                tensor=plan.targets[ops[failed].dst_index].fqn
                                if failed >= 0 else None)
            out.add(r)
            done += sum(o.src_bytes for o in ops)
            if progress is not None:
                progress(done, total)
    except BaseException:
        # every copy has left the buffers before they are freed and the callers' streams
        # wait for the copies; a copy error here does not replace the one propagating
        try:
            pipe.close()
        except Exception:
            pass
        raise
    pipe.close()
    return out
