"""Allocate and fill: real local blocks for every entry, written once (engine or checkpoint).

Nothing here touches the model: the blocks are swapped in by :mod:`.register` only after every
rank succeeded.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from ..fill_init import fill_many_
from ..fill_load import LoadStats, load_targets, plan_load
from .ckpt_view import CheckpointView, Rename
from .init import fix_zero_row
from .walk import Entry

__all__ = ["allocate", "fill_init", "plan_entries_load", "fill_load", "LoadResult"]

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def allocate(entries: Sequence[Entry], device: torch.device) -> int:
    """Give each entry real, uninitialised memory; returns the bytes allocated.

    FSDP2 parameters get FSDP's padded shard (``padded_sharded_param_size``, padding zeroed)
    with ``local`` the unpadded narrow view, so FSDP adopts the storage without a copy.
    """
    total = 0
    for e in entries:
        if e.fsdp is not None:
            fp = e.fsdp
            padded = torch.empty(tuple(fp.padded_sharded_param_size), dtype=e.dtype, device=device)
            dim = fp.fsdp_placement.dim
            n = e.local_shape[dim] if len(e.local_shape) else 0
            if padded.numel() and n < padded.shape[dim]:
                padded.narrow(dim, n, padded.shape[dim] - n).zero_()
            e.storage, e.local = padded, padded.narrow(dim, 0, n)
        else:
            e.storage = e.local = torch.empty(e.local_shape, dtype=e.dtype, device=device)
        total += e.storage.numel() * e.storage.element_size()
    return total


def fill_init(entries: Sequence[Entry], seed: int) -> int:
    """Fill entries with their fused distribution (skipping those left to ``reset_parameters``).

    Returns:
        Bytes written.
    """
    items, consts, written = [], [], 0
    for e in entries:
        d = e.default
        if d.dist is None or e.local.numel() == 0:
            continue
        written += e.nbytes
        if e.dtype not in _FUSED_DTYPES:
            consts.append(e)  # walk() allowed only Constant here
            continue
        for t in e.targets():
            x = t.tensor.view(1) if t.tensor.dim() == 0 else t.tensor
            ro = t.offsets[0] if t.offsets else 0
            co = t.offsets[1] if len(t.offsets) > 1 else 0
            items.append((x, d.dist, t.key, ro, co))
    fill_many_(items, seed=seed)
    with torch.no_grad():
        for e in consts:
            e.local.fill_(e.default.dist.value)
        for e in entries:
            if e.default.zero_row is not None and e.default.dist is not None:
                fix_zero_row(e.local, e.default.zero_row, e.offsets[0] if e.offsets else 0)
    return written


@dataclass
class LoadResult:
    """A load: what is read (``loaded``), what the checkpoint lacks (``missing``)."""

    stats: Optional[LoadStats]
    loaded: List[Entry] = field(default_factory=list)
    missing: List[Entry] = field(default_factory=list)
    prefix: str = ""
    view: Optional[CheckpointView] = None


def plan_entries_load(entries: Sequence[Entry], ckpt, *, strict: bool, dtype,
                      rename: Rename) -> LoadResult:
    """Match and validate (names, shapes, dtypes, coverage, files) without reading or writing.

    Returns:
        :class:`LoadResult` without stats: ``loaded`` (present), ``missing`` (absent, only with
        ``strict=False``), the view and the key prefix. Non-persistent buffers are in neither.

    Raises:
        metamat.CheckpointError subclasses.
    """
    wanted = [e for e in entries if e.persistent]
    view = CheckpointView(ckpt, {e.fqn: e.names for e in wanted},
                          {e.fqn: e.global_shape for e in wanted}, rename)
    plan_load([t for e in wanted for t in e.targets(tensor=None)], view, strict=strict,
              dtype=dtype, check_destinations=False)
    have = view.tensors()
    return LoadResult(None, [e for e in wanted if e.fqn in have],
                      [e for e in wanted if e.fqn not in have], view.prefix, view)


def fill_load(res: LoadResult, *, dtype, io_threads: Optional[int],
              progress: Optional[Callable[[int, int], None]],
              staging_bytes: int = 256 << 20, verify=None) -> LoadResult:
    """Read the blocks of ``res.loaded`` (a validated :func:`plan_entries_load`) into their
    allocated ``local`` tensors; non-CPU blocks go through CPU bounce tensors.

    Returns:
        ``res`` with ``stats`` set.

    ``verify``: None or a checksum ``Manifest`` every byte read is checked against.

    Raises:
        metamat.ReadError, ChecksumMismatchError (destinations may be partly written; the
        model is not touched).
    """
    copies = []
    targets = []
    for e in res.loaded:
        if e.local.device.type == "cpu":
            targets += e.targets()
        else:
            bounce = torch.empty(e.local_shape, dtype=e.dtype)
            copies.append((e, bounce))
            targets += e.targets(bounce)
    res.stats = load_targets(targets, res.view, strict=True, dtype=dtype, io_threads=io_threads,
                             staging_bytes=staging_bytes, progress=progress,
                             verify=verify or False)
    with torch.no_grad():
        for e, bounce in copies:
            e.local.copy_(bounce)
    return res
