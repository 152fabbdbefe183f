"""References to an ordinary module's meta tensors outside its parameter/buffer tables.

A module may keep a plain attribute that is the same tensor as one of its buffers (Hugging
Face rotary embeddings keep ``original_inv_freq``), or a view of a parameter. The object
graph (:func:`metamat.models.torchrec.graph.scan`) finds every such reference; each becomes
its twin in the new storage (same offset, shape and stride), so aliasing survives.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from ..allocate import Allocation
from ..plan import storage_key
from .modules import Entry

__all__ = ["Aliases", "find_aliases"]


class Aliases:
    """Meta tensors reachable from the model besides the registered ones, and their slots."""

    def __init__(self, graph, tensors: List[torch.Tensor]) -> None:
        self.graph = graph
        self.tensors = tensors

    def swap(self, alloc: Allocation) -> None:
        """Point every slot holding one of the tensors at its twin."""
        twins = alloc.twins()
        for t in self.tensors:
            new = twins[id(t)]
            for slot in self.graph.slots.get(id(t), []):
                holder = slot.holder
                if isinstance(holder, torch.Tensor) or slot.kind == "tuple":
                    continue  # a wrapper's own fields, or immutable (warned at find)
                slot.set(new)


def find_aliases(root: nn.Module, entries: Sequence[Entry], warnings: List[str]) -> Aliases:
    """The meta tensors reachable from ``root`` that view an entry's storage: those not
    registered as parameters/buffers, and the plain registered ones too, whose other
    references (a module's own dict of its parameters, as TorchRec's
    PositionWeightedModuleCollection keeps) must get the same new object."""
    from .torchrec.graph import is_wrapper_tensor, scan

    graph = scan(root)
    owned = {storage_key(e.old_local) for e in entries if e.meta}
    registered = {id(e.old) for e in entries} | {id(e.old_local) for e in entries}
    plain = {id(e.old) for e in entries if e.meta and e.mesh is None}  # new object: the twin
    out = []
    for t in graph.meta_tensors():
        if (id(t) in registered and id(t) not in plain) or is_wrapper_tensor(t) \
                or storage_key(t) not in owned:
            continue
        slots = graph.slots.get(id(t), [])
        if any(s.kind == "tuple" for s in slots):
            warnings.append(f"meta tensor {graph.tuple_path(t)} is held in an immutable container: "
                            "that reference stays on meta")
        out.append(t)
    return Aliases(graph, out)
