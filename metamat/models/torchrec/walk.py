"""TorchRec adapter, plan: every tensor of the sharded modules and how each byte gets its value.

Nothing is allocated here. The sharded collections are found by :mod:`.sharded`, their
targets by :mod:`.targets`, metadata values by :mod:`.values` (and :mod:`.cuda_plan` for
fbgemm's CUDA layout). The result is a ``TorchRecPlan``:

* ``targets``: one :class:`metamat.plan.Target` per local block of a checkpointable tensor of
  the sharded modules: embedding table shards (fqn = ``state_dict`` key, global offsets from
  the sharding) and fused-optimizer state (fqn = ``state.<param fqn>.<state name>``, the path in
  ``dmp.fused_optimizer.state_dict()``), and managed-collision state
  (:mod:`.managed_collision`). ``tensor`` holds a meta view until the bind stage
  swaps in the real one; blocks that already exist (an eager model) are real.
* ``storages``: every meta storage reachable from the model that the ordinary-module adapter
  does not own, with how it is initialised: ``targets`` (covered by targets, gaps zeroed),
  ``values`` (TBE/TorchRec metadata with known values), ``zeros``.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import StorageGroup, Target, storage_key
from .. import torch_upstream
from . import upstream
from .compat import check_versions
from .graph import Graph, scan
from .managed_collision import mc_collections, mc_targets
from .sharded import (check_node_groups, laid_out_for, named_wrappers, root_of,
                      sharded_modules, uses_torchrec)
from .targets import optimizer_targets, table_targets
from .values import known_values, put_value

__all__ = ["TorchRecPlan", "build_plan", "sharded_modules", "root_of", "laid_out_for"]


@dataclasses.dataclass
class TorchRecPlan:
    """What the TorchRec adapter found (module docstring)."""

    device: torch.device
    graph: Graph
    targets: List[Target]
    storages: Dict[int, StorageGroup]
    warnings: List[str] = dataclasses.field(default_factory=list)
    sharded: List[Tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    refill: Set[int] = dataclasses.field(default_factory=set)  # ids of real targets to refill
    names: Set[str] = dataclasses.field(default_factory=set)  # every state_dict key, any rank
    optim_names: Set[str] = dataclasses.field(default_factory=set)  # every optimizer state path
    cuda_tbes: list = dataclasses.field(default_factory=list)  # cuda_plan.CudaTBE, CUDA layout
    emulated: bool = False  # device is the CPU standing in for a CUDA device
    mcs: list = dataclasses.field(default_factory=list)  # (name, sharded MC collection)
    mc_targets: List[Target] = dataclasses.field(default_factory=list)  # their state
    # rank -> the device that rank materialized on, as every rank said at the fill agreement
    # (shard placements name them: register.rank_devices)
    peer_devices: Dict[int, str] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())


def _extent(t: torch.Tensor) -> int:
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        return (t.storage_offset() + t.numel()) * t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _refuse_scattered(sharded: List[Tuple[str, nn.Module]]) -> None:
    """A FULLY_SHARDED model between a training forward and its backward holds only its
    replica's slice of each table (TorchRec reduce-scatters the weights in the forward and
    gathers them back in the backward): nothing can be read or loaded whole then."""
    scattered = [name for name, w in named_wrappers(sharded) if upstream.weights_scattered(w)]
    if scattered:
        raise UnsupportedError(
            f"{scattered[0]}{f' and {len(scattered) - 1} more' if len(scattered) > 1 else ''}: "
            "its weights are reduce-scattered over the replicas (DMPCollection's "
            "FULLY_SHARDED strategy, after a training forward whose backward has not run; "
            "torchrec < 1.7 after any forward): materialize into the model after the "
            "backward, which gathers them back")


def build_plan(model: nn.Module, device: torch.device, init=None, *, claimed=frozenset(),
               loading: bool = False,
               sharded: Optional[List[Tuple[str, nn.Module]]] = None,
               emulated: bool = False) -> TorchRecPlan:
    """Validate ``model``'s sharded modules and plan their materialization on ``device``.
    Allocates no model memory (TBE metadata is rebuilt on ``device`` with floating storages
    kept on meta).

    Args:
        model: a DMP (or any module holding TorchRec sharded modules).
        device: where the tables will live.
        init: the validated ``init=`` mapping (table names or fqns -> values).
        claimed: keys of meta storages another adapter owns (ordinary modules' tensors).
        loading: a checkpoint will be loaded: real blocks become targets too.
        sharded: ``sharded_modules(root_of(model))`` when the caller has it already.
        emulated: ``device`` is the CPU standing in for a CUDA device
            (:mod:`metamat.emulation`).

    Raises:
        UnsupportedError: unsupported versions, kernels, module types, or a meta tensor
            whose value cannot be determined; a layout for another device.
        DeviceMemoryError: the tables do not fit in the GPU's free memory.
    """
    if uses_torchrec():
        check_versions()
    root = root_of(model)
    if sharded is None:
        sharded = sharded_modules(root)
    if sharded:
        # every TorchRec/fbgemm/torch internal this adapter reads, also those read only when
        # the tensors are registered (after the allocation): checked now
        upstream.require("train")
        upstream.check_sharded(sharded)
        upstream.check_dmp(model)
        check_node_groups(sharded)
    torch_upstream.require("module")
    _refuse_scattered(sharded)
    graph = scan(model)
    layout = laid_out_for(model, sharded)
    cuda = bool(sharded) and layout is not None
    if cuda and device.type != "cuda" and not emulated:
        raise UnsupportedError(
            f"this model's TorchRec tables are laid out for {layout} (shard_on_meta "
            f"with compute_device={str(layout)!r}); materialize them on a CUDA device "
            f"(device='cuda'), not on {device}"
        )
    if sharded and not cuda and (device.type != "cpu" or emulated):
        # A TBE sharded on meta was laid out for fbgemm's CPU kernels (HOST placement);
        # moving that layout to another device would give wrong lookups.
        raise UnsupportedError(
            "this model's TorchRec tables are laid out for fbgemm's CPU kernels; materialize "
            "it with device='cpu' (for GPUs shard it with metamat.shard_on_meta(..., "
            "compute_device='cuda'))"
        )
    warnings: List[str] = []
    refill: Set[int] = set()
    names: Set[str] = set()
    optim_names: Set[str] = set()
    targets = table_targets(sharded, init, warnings, loading, refill, names)
    for tg in targets:
        if id(tg) in refill and tg.tensor.device != device:
            # DMP(device=meta) on a GPU host: TorchRec builds DATA_PARALLEL tables for real
            # on the GPU (host_kernels.py); refilled there, the model would mix devices.
            raise UnsupportedError(
                f"{tg.fqn}: TorchRec allocated this table block on {tg.tensor.device} "
                "although the model was sharded on meta (it does so for data-parallel tables "
                f"when a GPU is visible); it cannot be materialized on {device}. Shard with "
                "metamat.shard_on_meta, which keeps it on meta"
            )
    targets += optimizer_targets(model, loading, optim_names)
    mcs = mc_collections(root) if sharded else []
    mc_state = mc_targets(mcs, loading, names)
    targets += mc_state
    meta = graph.meta_tensors()  # ~25 tensor objects per table: listed once

    storages: Dict[int, StorageGroup] = {}
    in_tuples = graph.tuple_held()
    starts = []  # contiguous tensors at offset 0: the only ones a recorded value can fill
    for t in meta:  # one pass (~5 tensors per table, nearly all views into a TBE's storage)
        if in_tuples and id(t) in in_tuples and not graph.tuple_swappable(t):
            raise UnsupportedError(
                f"meta tensor {graph.tuple_path(t)} is held in an immutable container; "
                "metamat cannot swap it"
            )
        st = t.untyped_storage()
        k = st._cdata  # storage_key(t) (torch_upstream: UntypedStorage._cdata)
        if claimed and k in claimed:
            continue
        g = storages.get(k)
        if g is None:
            # no `where`: a readable path costs ~5 µs and only an error message needs one
            # (a TBE has ~50 small metadata storages: 18k paths for 320 modules)
            g = storages[k] = StorageGroup(k, st.nbytes())
        g.tensors.append(t)
        # _extent(t), its common case inline (~5 meta tensors per table)
        if t.is_contiguous():
            offset = t.storage_offset()
            extent = (offset + t.numel()) * t.itemsize
            if not offset:
                starts.append(t)
        else:
            extent = _extent(t)
        if extent > g.nbytes:
            g.nbytes = extent
    tbes = []
    if cuda:
        from ...emulation import free_device_memory
        from .cuda_plan import check_device_memory, cuda_tbes, plan_cuda_storages

        tbes = cuda_tbes(named_wrappers(sharded))
    values = known_values(starts, sharded, device, skip={id(t.wrapper) for t in tbes})
    if cuda:
        plan_cuda_storages(tbes, storages, lambda old, new: put_value(values, old, new))
    for tg in targets:
        if not tg.tensor.is_meta:
            continue  # a real block: loaded (or a DATA_PARALLEL table DMP built, refilled)
        k = storage_key(tg.tensor)
        if k not in storages:  # reachable only through a state_dict view: still needs memory
            storages[k] = StorageGroup(k, tg.tensor.untyped_storage().nbytes(), where=tg.fqn)
        if not tg.tensor.is_contiguous():
            raise UnsupportedError(f"{tg.fqn}: local block is not contiguous in its storage")
        storages[k].kind = "targets"

    for k, v in values.items():
        g = storages.get(k)
        if g is not None and g.kind == "zeros":
            g.kind, g.value = "values", v
    if cuda:
        check_device_memory(list(storages.values()), tbes, device,
                            free_device_memory(device, emulated))
    for g in storages.values():
        if g.kind != "zeros" or g.nbytes == 0:
            continue
        if any(not t.is_floating_point() for t in g.tensors):
            where = g.where or graph.path(g.tensors[0])
            raise UnsupportedError(
                f"meta tensor {where} ({g.tensors[0].dtype}, shape "
                f"{tuple(g.tensors[0].shape)}) holds metadata metamat cannot compute; "
                "build the model with metamat.shard_on_meta"
            )
    return TorchRecPlan(device, graph, targets, storages, warnings, sharded, refill, names,
                        optim_names, cuda_tbes=tbes, emulated=emulated, mcs=mcs,
                        mc_targets=mc_state)
