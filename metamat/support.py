"""Fill stage, support bytes: every allocated byte no target owns gets its value once.

* ``values`` storages (metadata whose content the plan computed): copied in;
* ``zeros`` storages and the bytes of ``targets`` storages that no target covers (gaps
  between tables, FSDP2's shard padding): zeroed, except storages born zero
  (:mod:`metamat.allocate`), which need no write at all.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from .allocate import Allocation
from .plan import StorageGroup, Target

__all__ = ["fill_support", "is_broadcast"]


def _gaps(n: int, covered: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Byte ranges of ``[0, n)`` that no range of ``covered`` overlaps."""
    out, pos = [], 0
    for lo, hi in sorted(covered):
        if lo > pos:
            out.append((pos, lo))
        pos = max(pos, hi)
    if pos < n:
        out.append((pos, n))
    return out


def _zero_gaps(alloc: Allocation, key: int, covered: List[Tuple[int, int]]) -> int:
    gaps = _gaps(alloc.storages[key].nbytes(), covered)
    if gaps:  # a storage its targets cover (the common case) needs no view at all
        full = alloc.full(key)
        for lo, hi in gaps:
            full[lo:hi].zero_()
    return sum(hi - lo for lo, hi in gaps)


def is_broadcast(value: torch.Tensor) -> bool:
    """``value`` is one element broadcast to its shape (``expand`` of a scalar)."""
    return value.numel() > 1 and all(s == 0 for s in value.stride())


def fill_support(groups: Iterable[StorageGroup], targets: Iterable[Target],
                 alloc: Allocation) -> int:
    """Write the bytes of ``groups`` that ``targets`` (bound to the new storages) do not
    cover. Returns bytes written.

    Args:
        groups: the storage groups of one adapter.
        targets: every target whose tensor views one of those storages.
        alloc: the allocation (new storages, which were born zero).
    """
    covered: Dict[int, List[Tuple[int, int]]] = {}
    for tg in targets:
        x = tg.tensor
        if x is None or x.device.type == "meta":
            continue
        k = alloc.key_of(x)
        if k is None:
            continue
        isz = x.element_size()
        lo = x.storage_offset() * isz
        covered.setdefault(k, []).append((lo, lo + x.numel() * isz))
    written = 0
    with torch.no_grad():
        for g in groups:
            if g.kind in ("targets", "zeros") and g.key in alloc.zeroed:
                continue  # born zero: gaps and zero storages need no write
            if g.kind == "targets":
                written += _zero_gaps(alloc, g.key, covered.get(g.key, []))
            elif g.kind == "zeros":
                alloc.full(g.key).zero_()
                written += g.nbytes
            elif g.kind == "values":
                dst = alloc.full(g.key)
                n = g.value.numel() * g.value.element_size()
                if is_broadcast(g.value):  # one value everywhere: filled where dst is
                    dst[:n].view(g.value.dtype).fill_(g.value[(0,) * g.value.dim()].item())
                else:
                    dst[:n].copy_(g.value.contiguous().view(-1).view(torch.uint8))
                if n < dst.numel():
                    dst[n:].zero_()
                written += g.nbytes
    return written

