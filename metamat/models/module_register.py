"""Bind and register for ordinary modules: real local tensors for the entries, swapped in.

:func:`bind` (after the allocate stage) gives every meta entry its real local block (a view of
the new storage, so FSDP2's padded shard keeps its layout), points its targets at it and
builds the object that will be registered: the entry's twin (same class and requires_grad)
for a plain tensor, ``DTensor.from_local(...)`` (in a Parameter if it was one) for a DTensor.
:func:`register` (after every rank agreed) puts those objects in every slot and hands FSDP2
its new sharded parameters; it cannot fail on bad input (everything was validated before).
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import nn

from ..allocate import Allocation
from .module_values import Decision
from . import torch_upstream
from .modules import Entry, entry_targets

__all__ = ["bind", "register"]


def _wrap(e: Entry, local: torch.Tensor):
    if e.mesh is None:
        return nn.Parameter(local, requires_grad=e.requires_grad) if e.is_param else local
    from torch.distributed.tensor import DTensor

    x = DTensor.from_local(local, e.mesh, e.placements, run_check=False,
                           shape=torch.Size(e.global_shape), stride=e.global_stride)
    return nn.Parameter(x, requires_grad=e.requires_grad) if e.is_param else x


def bind(entries: Sequence[Entry], dec: Dict[int, Decision], alloc: Allocation,
         device: torch.device) -> None:
    """Real local tensors and the objects to register, for meta entries and for real plain
    tensors that must move to ``device`` (copied, or left empty when the checkpoint fills
    them); the new memory of moved ones is adopted into ``alloc``."""
    for e in entries:
        if e.meta:
            e.local = alloc.view(e.old_local)
            e.new = alloc.twin(e.old, e.local) if e.mesh is None else _wrap(e, e.local)
        elif e.mesh is None and e.old.device != device:
            x = e.old_local
            with torch.no_grad():
                e.local = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
                           if dec[id(e)].kind == "checkpoint" else x.to(device))
            alloc.adopt(e.local)
            e.new = _wrap(e, e.local)
        else:
            continue
        if len(e.targets) == 1 and len(e.global_shape) <= 2:
            e.targets[0].tensor = e.local  # what entry_targets gives a 0-2-D tensor
            continue
        for t, fresh in zip(e.targets, entry_targets(e, e.local)):
            t.tensor = fresh.tensor


def _adopt_fsdp(e: Entry, alloc: Allocation) -> None:
    """Point the FSDPParam at the new parameter and its padded storage.

    ``reset_sharded_param`` (what FSDP runs after ``to_empty``/``load_state_dict(assign=True)``)
    re-reads the module's parameter; with ``_sharded_param_data`` already on our padded storage
    it recognises the same memory and copies nothing.
    """
    fp = e.fsdp
    padded = torch_upstream.fsdp_padded_shard(fp)
    # a TorchRec model's object-graph walk may have swapped it already (its twin on the new
    # storage): FSDP's state is among the objects it visits
    torch_upstream.fsdp_adopt(fp, alloc.view(padded) if padded.is_meta else padded, e.new)
    if fp.sharded_param is not e.new:  # pragma: no cover - FSDP internals changed
        raise RuntimeError(f"FSDP did not adopt the new parameter for {e.fqn!r}")


def register(entries: Sequence[Entry], alloc: Allocation) -> int:
    """Replace each meta (or moved) tensor by its new object everywhere it is registered
    (tied parameters stay one object). Returns the number of objects replaced."""
    n = 0
    with torch.no_grad():
        for e in entries:
            if e.new is None:
                continue
            for s in e.slots:
                (s.module._parameters if s.is_param else s.module._buffers)[s.name] = e.new
            if e.fsdp is not None and e.meta:
                _adopt_fsdp(e, alloc)
            n += 1
    return n
