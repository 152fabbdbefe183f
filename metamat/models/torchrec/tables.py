"""TorchRec adapter, fill: table shards and optimizer state that no checkpoint provides.

* table shards and optimizer state: ``metamat.fill_many_`` (fused engine, plan-invariant);
* tables whose ``init_fn`` is not a known distribution (or an ``init=`` callable/tensor):
  the callable on each local shard, seeded per block;
* zero state whose storage was born zero needs no write at all.

On a CUDA device, blocks in device memory are written by one kernel launch per device; blocks
in fbgemm's unified memory (UVM tables) by the CPU engine through their host alias, where the
bytes live. On the emulated device (:mod:`metamat.emulation`) the device-memory blocks go
through the kernel's host emulation.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ...allocate import DEVICE, Allocation, is_zero_dist
from ...init import fill_many_, fill_many_emulated_
from ...plan import Target
from ...rng import seeded
from ..module_values import module_seed

__all__ = ["fill_targets", "needs_write"]


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t


def fill_targets(targets: List[Target], seed: int, alloc: Optional[Allocation] = None) -> int:
    """Initialise table/optimizer-state targets: the fused engine for distributions, the
    callable (seeded per block) otherwise. ``alloc``: where unified memory has its host
    alias (module docstring). Returns bytes written."""
    items, emulated, written = [], [], 0
    with torch.no_grad():
        for tg in targets:
            if getattr(tg.init_fn, "metamat_unseeded", False):  # a known value
                tg.init_fn(tg.tensor, tg.offsets)
                written += tg.nbytes
            elif tg.init_fn is not None:
                with seeded(module_seed(seed, f"{tg.fqn}@{tg.offsets}"), [tg.tensor.device]):
                    if getattr(tg.init_fn, "metamat_block", False):
                        tg.init_fn(tg.tensor, tg.offsets)
                    else:
                        tg.init_fn(tg.tensor)
                written += tg.nbytes
            else:
                off = tuple(tg.offsets) + (0, 0)
                t = tg.tensor if alloc is None else alloc.host_view(tg.tensor)
                device_memory = alloc is not None and alloc.emulated and \
                    alloc.memory_of(t) == DEVICE
                (emulated if device_memory else items).append(
                    (_as_2d(t), tg.dist, tg.key, int(off[0]), int(off[1])))
        if items:
            fill_many_(items, seed=seed)
        if emulated:
            fill_many_emulated_(emulated, seed=seed)
        written += sum(t.numel() * t.element_size() for t, *_ in items + emulated)
    return written


def needs_write(targets: List[Target], alloc: Allocation) -> List[Target]:
    """Drop the targets whose value is zero and whose storage was born zero."""
    out = []
    for tg in targets:
        if tg.init_fn is None and is_zero_dist(tg.dist):
            k = alloc.key_of(tg.tensor)
            if k is not None and k in alloc.zeroed:
                continue
        out.append(tg)
    return out
