"""Fill stage (init path): write every allocated byte once.

* table shards and optimizer state: ``metamat.fill_many_`` (fused engine, plan-invariant);
* tables whose ``init_fn`` is not a known distribution: the callable on each local shard;
* TBE/TorchRec metadata: copied from values computed in the plan stage;
* bytes of a table storage no target covers, and storages nobody else fills: zeros;
* dense modules: ``reset_parameters()`` under a fixed per-module seed, then ``init=``
  overrides.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Tuple

import torch

from ..allocate import is_zero_dist
from ..plan import Target
from .allocate import Allocation
from .walk import Plan

__all__ = ["fill_init", "fill_support", "fill_targets", "needs_write"]


def _module_seed(seed: int, fqn: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) & 0x7FFF_FFFF_FFFF_FFFF


def _zero_gaps(alloc: Allocation, key: int, covered: List[Tuple[int, int]]) -> int:
    full = alloc.full(key)
    n, pos, written = full.numel(), 0, 0
    for lo, hi in sorted(covered):
        if lo > pos:
            full[pos:lo].zero_()
            written += lo - pos
        pos = max(pos, hi)
    if pos < n:
        full[pos:n].zero_()
        written += n - pos
    return written


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t


def _table_targets(plan: Plan, alloc: Allocation) -> List[Target]:
    dense_keys = {k for k, g in plan.storages.items() if g.kind == "dense"}
    return [tg for tg in plan.targets if alloc.target_storage[id(tg)] not in dense_keys]


def fill_support(plan: Plan, alloc: Allocation) -> int:
    """Write every byte no target owns: metadata values, zero storages, and the gaps
    between targets in table storages. Returns bytes written."""
    written = 0
    covered: Dict[int, List[Tuple[int, int]]] = {}
    for tg in _table_targets(plan, alloc):
        k = alloc.target_storage[id(tg)]
        isz = tg.tensor.element_size()
        lo = tg.tensor.storage_offset() * isz
        covered.setdefault(k, []).append((lo, lo + tg.tensor.numel() * isz))
    with torch.no_grad():
        for k, g in plan.storages.items():
            if g.kind in ("targets", "zeros") and k in alloc.zeroed:
                continue  # born zero (allocate.py): gaps and zero storages need no write
            if g.kind == "targets":
                written += _zero_gaps(alloc, k, covered.get(k, []))
            elif g.kind == "zeros":
                alloc.full(k).zero_()
                written += g.nbytes
            elif g.kind == "values":
                dst = alloc.full(k)
                src = g.value.contiguous().view(-1).view(torch.uint8)
                dst[: src.numel()].copy_(src)
                if src.numel() < dst.numel():
                    dst[src.numel():].zero_()
                written += g.nbytes
    return written


def fill_targets(targets: List[Target], seed: int) -> int:
    """Initialise table/optimizer-state targets: the fused engine for distributions, the
    callable (seeded per block) for custom ``init_fn``. Returns bytes written."""
    from .. import fill_many_

    items, written = [], 0
    with torch.no_grad():
        for tg in targets:
            if tg.init_fn is not None:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_module_seed(seed, f"{tg.fqn}@{tg.offsets}"))
                    tg.init_fn(tg.tensor)
                written += tg.nbytes
            else:
                off = tuple(tg.offsets) + (0, 0)
                items.append((_as_2d(tg.tensor), tg.dist, tg.key, int(off[0]), int(off[1])))
        if items:
            fill_many_(items, seed=seed)
            written += sum(t.numel() * t.element_size() for t, *_ in items)
    return written


def needs_write(targets: List[Target], alloc: Allocation) -> List[Target]:
    """Drop the targets whose value is zero and whose storage was born zero."""
    return [tg for tg in targets
            if not (tg.init_fn is None and is_zero_dist(tg.dist)
                    and alloc.target_storage.get(id(tg)) in alloc.zeroed)]


def fill_init(plan: Plan, alloc: Allocation, seed: int) -> int:
    """Initialise every allocated storage of ``plan`` (the init path). Returns bytes
    written. The load path replaces ``fill_targets`` by the checkpoint loader and keeps
    ``fill_support`` (metadata, gaps) and ``fill_dense`` for anything not loaded."""
    written = fill_support(plan, alloc)
    written += fill_targets(needs_write(_table_targets(plan, alloc), alloc), seed)
    with torch.no_grad():
        written += _fill_dense(plan, alloc, seed)
    return written


def _fill_dense(plan: Plan, alloc: Allocation, seed: int) -> int:
    from .. import fill_many_

    written = 0
    by_fqn = {tg.fqn: tg for tg in plan.targets}
    for d in plan.dense:
        m = d.module
        prefix = f"{d.fqn}." if d.fqn else ""
        saved_p, saved_b = dict(m._parameters), dict(m._buffers)
        try:
            for n in d.names:
                if n in m._parameters:
                    m._parameters[n] = alloc.twins[id(saved_p[n])]
                else:
                    m._buffers[n] = alloc.twins[id(saved_b[n])]
                    m._buffers[n].zero_()
            if d.reset:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_module_seed(seed, d.fqn))
                    m.reset_parameters()
            items = []
            for n in d.names:
                tg = by_fqn.get(prefix + n)
                if tg is not None and tg.dist is not None:
                    items.append((_as_2d(tg.tensor), tg.dist, tg.key, 0, 0))
            if items:
                fill_many_(items, seed=seed)
        finally:
            m._parameters.clear()
            m._parameters.update(saved_p)
            m._buffers.clear()
            m._buffers.update(saved_b)
        for n in d.names:
            t = saved_p.get(n) if n in saved_p else saved_b[n]
            written += t.numel() * t.element_size()
    return written
