"""Allocate stage: one real storage per meta storage, and a real twin of every meta tensor.

Views keep their exact (storage offset, shape, stride) in the new storage, so every alias
TorchRec built on meta (TableBatchedEmbeddingSlice, Shards, optimizer-state views of the
TBE's flat buffers) aliases the new storage the same way. Nothing in the model changes
here: the twins are swapped in by the register stage. Memory is allocated, not touched.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Set

import torch
from torch import nn

from ..allocate import LAZY_ZERO_MIN_BYTES, zeroed_cpu_storage
from .walk import Plan, storage_key

__all__ = ["Allocation", "allocate"]


@dataclasses.dataclass
class Allocation:
    device: torch.device
    storages: Dict[int, torch.UntypedStorage]
    twins: Dict[int, torch.Tensor]  # id(old meta tensor) -> new tensor object
    target_storage: Dict[int, int] = dataclasses.field(default_factory=dict)  # id(Target) -> meta storage key
    zeroed: Set[int] = dataclasses.field(default_factory=set)  # keys of storages born zero

    def view(self, old: torch.Tensor) -> torch.Tensor:
        """A real tensor viewing the new storage exactly as ``old`` views its meta one."""
        st = self.storages[storage_key(old)]
        t = torch.empty((0,), dtype=old.dtype, device=self.device)
        t.set_(st, old.storage_offset(), old.shape, old.stride())
        return t

    def full(self, key: int) -> torch.Tensor:
        """The whole new storage as a uint8 tensor."""
        st = self.storages[key]
        return torch.empty((0,), dtype=torch.uint8, device=self.device).set_(st, 0, (st.nbytes(),), (1,))


def _twin(alloc: Allocation, old: torch.Tensor) -> torch.Tensor:
    view = alloc.view(old)
    cls = type(old)
    if cls is torch.Tensor:
        if old.requires_grad:
            view.requires_grad_(True)
        return view
    if issubclass(cls, nn.Parameter):
        return torch.Tensor._make_subclass(cls, view, old.requires_grad)
    return view.as_subclass(cls)


def allocate(plan: Plan) -> Allocation:
    """Allocate every planned storage on ``plan.device`` and build the tensor twins.

    Target tensors are replaced by real views (the plan's meta views are dropped).
    """
    storages, zeroed = {}, set()
    for k, g in plan.storages.items():
        if plan.device.type == "cpu" and g.nbytes >= LAZY_ZERO_MIN_BYTES:
            storages[k] = zeroed_cpu_storage(g.nbytes)  # zero pages on demand: no zero pass
            zeroed.add(k)
        else:
            storages[k] = torch.UntypedStorage(g.nbytes, device=plan.device)
    alloc = Allocation(plan.device, storages, {}, zeroed=zeroed)
    for t in plan.graph.meta_tensors():
        alloc.twins[id(t)] = _twin(alloc, t)
    # Copy the python-side state (dict, slots) of tensor subclasses, mapping tensors to twins.
    for t in plan.graph.meta_tensors():
        new = alloc.twins[id(t)]
        d = getattr(t, "__dict__", None)
        if d:
            for k, v in d.items():
                if k == "_metamat_value":
                    continue
                new.__dict__[k] = alloc.twins.get(id(v), v)
        for cls in type(t).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if not isinstance(name, str) or name in ("__dict__", "__weakref__"):
                    continue
                try:
                    v = object.__getattribute__(t, name)
                except AttributeError:
                    continue
                object.__setattr__(new, name, alloc.twins.get(id(v), v))
    for tg in plan.targets:
        alloc.target_storage[id(tg)] = storage_key(tg.tensor)
        if tg.tensor.device.type != "meta":
            continue  # already real (a DATA_PARALLEL table DMP built on CPU): filled in place
        tg.tensor = alloc.twins.get(id(tg.tensor)) if id(tg.tensor) in alloc.twins else alloc.view(tg.tensor)
    return alloc
