"""The load stage: fill allocated targets from a checkpoint, reading only the bytes they need.

Layers, lowest first (each imports only those before it):

* :mod:`.ops`: ``ReadOp``, packing for the C++ reader, cutting and batching;
* :mod:`.plan`: :func:`plan_reads` matches targets to checkpoint chunks and validates
  everything before the first byte is read (pure, allocates nothing): the :class:`ReadPlan`;
* :mod:`.verify`: checksum manifests checked while streaming;
* :mod:`.execute` (host destinations, read in place), :mod:`.staged` (device destinations,
  through a ring of pinned staging buffers) and :mod:`.remote` (files of a storage without OS
  files, e.g. S3: ranged reads);
* this module: :func:`execute`, the one entry every model kind calls, and
  :func:`load_targets` (plan + execute, for callers holding bare targets).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch

from ..budget import StagingBudget
from ..checkpoint import storage as fs
from ..checkpoint.base import Checkpoint
from ..plan import Target
from .execute import Executed, execute_plan
from .ops import ReadOp, default_io_threads
from .plan import LoadPlan, ReadPlan, plan_load, plan_reads, validate_destination
from .verify import resolve_manifest

__all__ = ["ReadOp", "ReadPlan", "LoadStats", "plan_reads", "execute", "load_targets",
           "validate_destination", "resolve_manifest", "default_io_threads",
           "LoadPlan", "plan_load"]


@dataclass
class LoadStats(Executed):
    """What a load did: the executor's counters (:class:`~metamat.load.execute.Executed`:
    ``bytes_read`` with the gaps of coalesced strided reads, ``bytes_verified`` against the
    checksum manifest, ``bytes_reread`` of those read again to complete a block's hash,
    ``bytes_direct``, ``staging_seconds`` of ``seconds`` spent allocating (for CUDA:
    page-locking) the staging ring, ``stage``), and:

    Attributes:
        bytes_needed: checkpoint bytes the targets need (source dtype).
        read_amplification: ``bytes_read / bytes_needed`` (1.0 when nothing was needed).
        seconds: wall time of planning plus reading.
        missing: targets not in the checkpoint (non-strict); the caller initialises them.
        loaded: number of targets filled.
        ops: number of read ops executed.
    """

    bytes_needed: int = 0
    read_amplification: float = 1.0
    seconds: float = 0.0
    missing: List[Target] = field(default_factory=list)
    loaded: int = 0
    ops: int = 0

    @property
    def gbps(self) -> float:
        """Needed bytes per second, in GB/s (1e9)."""
        return self.bytes_needed / self.seconds / 1e9 if self.seconds > 0 else 0.0


def execute(plan: ReadPlan, *, io_threads: Optional[int] = None,
            staging_bytes: int = 256 << 20,
            progress: Optional[Callable[[int, int], None]] = None,
            verify=None, staged: Union[bool, Callable[[Target], bool]] = False,
            io: str = "auto") -> Executed:
    """Run a validated plan whose targets hold allocated tensors, on any devices.

    Host destinations are read in place (:mod:`.execute`); device ones go through the
    staging ring (:mod:`.staged`). The host memory used is ``staging_bytes`` at most
    (:class:`metamat.budget.StagingBudget`).

    Args:
        plan: from :func:`plan_reads`, with every target's ``tensor`` real.
        io_threads: reader threads (default :func:`default_io_threads`: this process's CPUs,
            shared by the node's ranks, at most 16).
        staging_bytes: host memory budget for bounce and staging buffers.
        progress: ``progress(bytes_done, bytes_total)`` between batches.
        verify: None or a checksum ``Manifest`` (:func:`resolve_manifest`).
        staged: send host destinations through the staging ring too: True for all of them
            (tests), or a predicate choosing targets (the emulated CUDA device's device memory).
        io: ``"auto"`` (large reads not in the page cache stream through it and are dropped
            behind; see :data:`~metamat.load.execute.IO_MODES`), ``"buffered"``, ``"direct"``.

    Returns:
        :class:`~metamat.load.execute.Executed`.

    Raises:
        ReadError, ChecksumMismatchError: destinations may be partly written.
        ValueError: a bad ``io_threads``/``staging_bytes``.
    """
    if plan.files and not fs.storage_for(plan.files[0]).os_files:  # objects: ranged reads
        from .remote import execute_plan_remote
        return execute_plan_remote(plan, staging_bytes=int(staging_bytes), progress=progress,
                                   verify=verify)
    threads = default_io_threads() if io_threads is None else io_threads
    def ring(t: Target) -> bool:
        if t.tensor.device.type != "cpu":
            return True
        return staged(t) if callable(staged) else bool(staged)

    through_ring = [ring(t) for t in plan.targets]
    on_device = [i for i, r in enumerate(through_ring) if r]
    on_host = [i for i, r in enumerate(through_ring) if not r]
    out = Executed()
    total = plan.src_bytes
    done = 0

    def part(cb_base: int):
        if progress is None:
            return None
        return lambda d, _t: progress(cb_base + d, total)

    for keep, use_ring in ((on_host, False), (on_device, True)):
        if not keep:
            continue
        sub = plan if len(keep) == len(plan.targets) else plan.subplan(keep)
        budget = StagingBudget.split(int(staging_bytes), threads, staged=use_ring)
        if use_ring:
            from .staged import execute_plan_staged
            r = execute_plan_staged(sub, budget, progress=part(done), verify=verify, io=io)
        else:
            r = execute_plan(sub, budget, progress=part(done), verify=verify, io=io)
        out.merge(r)
        done += sub.src_bytes
    return out


def load_targets(targets: Sequence[Target], ckpt: Checkpoint, *, strict: bool = True,
                 dtype: Union[None, str, torch.dtype] = None, io_threads: Optional[int] = None,
                 staging_bytes: int = 256 << 20,
                 progress: Optional[Callable[[int, int], None]] = None,
                 staged: bool = False, verify=False, io: str = "auto") -> LoadStats:
    """Fill each target's ``tensor`` with its block of the checkpoint tensor ``target.fqn``.

    Everything is validated (see :func:`plan_reads`) before the first byte is written, so a
    failed validation leaves every destination as it was.

    Args:
        targets: allocated targets (``tensor`` set, CPU or CUDA).
        ckpt: an opened checkpoint (:func:`metamat.open_checkpoint`).
        strict: missing fqns raise :class:`MissingTensorError`; else they are returned in
            ``LoadStats.missing`` for the caller to initialise.
        dtype: conversion policy (:mod:`.plan`).
        io_threads, staging_bytes, progress, staged, io: see :func:`execute`.
        verify: False; True to check every byte read against the checkpoint's checksum
            manifest while streaming; or an already read ``Manifest``.

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
    plan = plan_reads(targets, ckpt, strict=strict, dtype=dtype)
    r = execute(plan, io_threads=io_threads, staging_bytes=staging_bytes, progress=progress,
                verify=manifest, staged=staged, io=io)
    stats = LoadStats(bytes_needed=plan.bytes_needed, missing=plan.missing,
                      loaded=len(plan.targets), ops=len(plan.ops))
    stats.merge(r)
    stats.read_amplification = r.bytes_read / plan.bytes_needed if plan.bytes_needed else 1.0
    stats.seconds = time.perf_counter() - t0
    return stats
