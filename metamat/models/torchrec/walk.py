"""TorchRec adapter, find: every tensor of the sharded modules and how each byte gets its value.

Nothing is allocated here. The result is a ``TorchRecPlan``:

* ``targets``: one :class:`metamat.plan.Target` per local block of a checkpointable tensor of
  the sharded modules: embedding table shards (fqn = ``state_dict`` key, global offsets from
  the sharding) and fused-optimizer state (fqn = ``state.<param fqn>.<state name>``, the path in
  ``dmp.fused_optimizer.state_dict()``). ``tensor`` holds a meta view until the bind stage
  swaps in the real one; blocks that already exist (an eager model) are real.
* ``storages``: every meta storage reachable from the model that the ordinary-module adapter
  does not own, with how it is initialised: ``targets`` (covered by targets, gaps zeroed),
  ``values`` (TBE/TorchRec metadata with known values), ``zeros``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ...errors import UnsupportedError
from ...plan import StorageGroup, Target, storage_key
from ...rules import default_table_dist, dist_from_init_fn, match_init
from ...spec import Dist, Zeros
from .compat import check_versions
from .graph import Graph, scan
from .meta_factories import recorded_value
from .state_dict import module_state_dict

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

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())


def root_of(model: nn.Module) -> nn.Module:
    """The module whose ``named_modules`` names match ``model.state_dict()`` keys (a DMP's
    wrapped module, else the model)."""
    return model.module if hasattr(model, "_dmp_wrapped_module") else model


def _unwrap(m: Any) -> Any:
    while hasattr(m, "module") and isinstance(m, torch.nn.parallel.DistributedDataParallel):
        m = m.module
    return m


def _uses_torchrec() -> bool:
    # A model can only hold TorchRec modules if torchrec was imported.
    import sys

    return "torchrec" in sys.modules


def sharded_modules(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    if not _uses_torchrec():
        return []
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.types import ShardedModule

    from ..modules import named_modules_pruned

    tables = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)
    out = []
    # not below a table module: its ~1 module per table is never a sharded module
    for name, m in named_modules_pruned(root, lambda _n, m: isinstance(m, tables)):
        if isinstance(m, tables):
            out.append((name, m))
        elif isinstance(m, ShardedModule) and not _is_container(m):
            if any(p.is_meta for p in _tensors_of(m)):
                raise UnsupportedError(
                    f"{name or '<root>'}: sharded module type {type(m).__name__} is not supported "
                    "(supported: ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)"
                )
    return out


def _is_container(m: nn.Module) -> bool:
    """A sharded module whose tables are a ShardedEmbeddingBagCollection child (found on its
    own by ``named_modules``) and whose other state is ordinary modules and tensors: TorchRec's
    ShardedFeatureProcessedEmbeddingBagCollection (position-weighted features)."""
    try:
        from torchrec.distributed.fp_embeddingbag import (
            ShardedFeatureProcessedEmbeddingBagCollection as FP)
    except ImportError:  # a TorchRec without feature processors
        return False
    return isinstance(m, FP)


def _tensors_of(m: nn.Module) -> List[torch.Tensor]:
    try:
        return list(m.parameters()) + list(m.buffers())
    except Exception:  # noqa: BLE001 - some sharded modules refuse; treat as opaque
        return []


def _wrappers(sm: nn.Module) -> List[nn.Module]:
    from torchrec.distributed.batched_embedding_kernel import (
        BatchedDenseEmbedding,
        BatchedDenseEmbeddingBag,
        BatchedFusedEmbedding,
        BatchedFusedEmbeddingBag,
    )

    supported = (BatchedFusedEmbeddingBag, BatchedDenseEmbeddingBag, BatchedFusedEmbedding,
                 BatchedDenseEmbedding)
    out = []
    for lookup in sm._lookups:
        lookup = _unwrap(lookup)
        for w in getattr(lookup, "_emb_modules", []):
            if type(w) not in supported:
                raise UnsupportedError(
                    f"compute kernel module {type(w).__name__} is not supported "
                    f"(supported: {', '.join(c.__name__ for c in supported)})"
                )
            out.append(w)
    return out


def laid_out_for(model: nn.Module, sharded: List[Tuple[str, nn.Module]]) -> Optional[torch.device]:
    """The CUDA device a model's TBEs are laid out for (``shard_on_meta(compute_device=
    "cuda")``, or an eager DMP built on a GPU), else None (fbgemm's CPU layout)."""
    dev = getattr(model, "_metamat_compute_device", None)
    if dev is not None or not sharded:
        return dev
    for _, w in _named_wrappers(sharded):
        specs = getattr(getattr(w, "_emb_module", None), "embedding_specs", None) or []
        if any(len(s) > 3 and getattr(s[3], "name", "") == "CUDA" for s in specs):
            return torch.device("cuda")
    return None


def _named_wrappers(sharded: List[Tuple[str, nn.Module]]) -> List[Tuple[str, nn.Module]]:
    """(readable path, kernel wrapper) of every sharded module's lookups."""
    out = []
    for name, sm in sharded:
        for i, lookup in enumerate(sm._lookups):
            for j, w in enumerate(getattr(_unwrap(lookup), "_emb_modules", [])):
                out.append((f"{name or '<root>'}._lookups[{i}]._emb_modules[{j}]", w))
    return out


def _table_configs(sm: nn.Module) -> Dict[str, Any]:
    """Table name -> the user's config (with its ``init_fn``). TorchRec keeps the module's
    configs on the sharded module; the kernels' ShardedEmbeddingTable copies lose init_fn."""
    out = {}
    for attr in ("_embedding_bag_configs", "_embedding_configs"):
        for cfg in getattr(sm, attr, None) or []:
            out.setdefault(cfg.name, cfg)
    if out:
        return out
    for w in _wrappers(sm):
        for t in w._config.embedding_tables:
            out.setdefault(t.name, t)
    return out


def _local_blocks(value: Any) -> List[Tuple[torch.Tensor, Tuple[int, ...], Tuple[int, ...]]]:
    """(local tensor, offsets, global shape) for a state_dict value."""
    if hasattr(value, "local_shards"):
        # ShardedTensor.size() goes through __torch_function__ (~150 µs); its metadata is plain
        md = getattr(value, "metadata", None)
        gshape = tuple(md().size) if callable(md) else tuple(value.size())
        return [(s.tensor, tuple(s.metadata.shard_offsets), gshape) for s in value.local_shards()]
    if hasattr(value, "_local_tensor"):  # DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return [(value._local_tensor, tuple(off), tuple(value.shape))]
    return [(value, tuple(0 for _ in value.shape), tuple(value.shape))]


def _table_name_from_key(key: str) -> Optional[Tuple[str, str]]:
    parts = key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in ("embedding_bags", "embeddings"):
        return ".".join(parts[:-3]), parts[-2]
    return None


def _table_targets(sharded: List[Tuple[str, nn.Module]], init, warnings: List[str],
                   loading: bool, refill: Set[int], names: Set[str]) -> List[Target]:
    """Targets of every table shard (meta ones; real ones beside meta ones, which are
    refilled and recorded in ``refill``; all real ones when ``loading``). ``names`` receives
    every state_dict key of the sharded modules, with or without a block on this rank."""
    configs: Dict[str, Dict[str, Any]] = {name: _table_configs(sm) for name, sm in sharded}
    targets = []
    for name, sm in sharded:
        prefix = f"{name}." if name else ""
        warned = set()
        sd = module_state_dict(sm, prefix)  # sm.state_dict(prefix=prefix), faster
        # DMP(device=meta) still builds DATA_PARALLEL tables on CPU with torch's RNG; refill
        # them (in place) when the module's other tables are on meta, so every table gets
        # plan-invariant values.
        any_meta = any(b[0].is_meta for v in sd.values() if isinstance(v, torch.Tensor)
                       for b in _local_blocks(v))
        names.update(k for k, v in sd.items() if isinstance(v, torch.Tensor))
        for key, value in sd.items():
            tn = _table_name_from_key(key)
            if tn is None:
                continue
            table = tn[1]
            cfg = configs[name].get(table)
            if cfg is None:
                continue
            dist = match_init(init, (key, table))
            init_fn = None
            if dist is not None and not isinstance(dist, Dist):
                init_fn, dist = _init_callable(key, dist), None
            elif dist is None:
                if cfg.init_fn is None:
                    dist = default_table_dist(cfg.num_embeddings)
                else:
                    dist = dist_from_init_fn(cfg.init_fn)
                    if dist is None:
                        init_fn = cfg.init_fn
                        if table not in warned:
                            warned.add(table)
                            warnings.append(
                                f"table {table!r}: init_fn {cfg.init_fn!r} is not a known "
                                "distribution; applying it to each local shard (slower, and "
                                "values depend on the sharding plan)"
                            )
            for local, offsets, gshape in _local_blocks(value):
                if local.numel() == 0 or (not local.is_meta and not any_meta
                                          and not loading):
                    continue
                # positional (~0.5 µs per target less than keywords): fqn, key, global_shape,
                # offsets, local_shape, dtype, dist, tensor, init_fn
                targets.append(Target(key, table, gshape, offsets, tuple(local.shape),
                                      local.dtype, dist, local, init_fn))
                if not local.is_meta and any_meta:
                    refill.add(id(targets[-1]))
        for key, value in sd.items():  # real non-table tensors of the module (eager loads)
            if not loading or _table_name_from_key(key) is not None \
                    or not isinstance(value, torch.Tensor):
                continue
            for local, offsets, gshape in _local_blocks(value):
                if not local.is_meta and local.numel():
                    targets.append(Target(fqn=key, key=key, global_shape=gshape,
                                          offsets=offsets, local_shape=tuple(local.shape),
                                          dtype=local.dtype, tensor=local))
    return targets


def _init_callable(key: str, value):
    """An ``init=`` tensor or callable for a table, as a per-block init_fn."""
    if isinstance(value, torch.Tensor):
        def copy_block(t: torch.Tensor, offsets, _v=value) -> None:
            t.copy_(_v[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))])
        copy_block.metamat_block = True
        return copy_block
    return value


_ZEROS = Zeros()  # frozen: one for every optimizer state block


def _optimizer_targets(model: nn.Module, loading: bool, names: Set[str]) -> List[Target]:
    """Targets of the fused optimizer's state: the meta blocks, and when ``loading`` the
    blocks already on a real device too (an eager model). ``names`` receives every state
    path, with or without a block on this rank."""
    fo = getattr(model, "fused_optimizer", None)
    if fo is None:
        return []
    try:
        sd = fo.state_dict()
    except Exception as e:  # noqa: BLE001
        raise UnsupportedError(f"fused_optimizer.state_dict() failed on meta: {e}") from e
    targets = []
    for pfqn, states in sd.get("state", {}).items():
        for sname, value in states.items():
            if not isinstance(value, torch.Tensor):
                continue
            path = f"state.{pfqn}.{sname}"
            names.add(path)
            for local, offsets, gshape in _local_blocks(value):
                if local.numel() == 0 or (not local.is_meta and not loading):
                    continue
                tg = Target(path, sname, gshape, offsets, tuple(local.shape), local.dtype,
                            _ZEROS, local)  # positional, as in _table_targets
                tg.optimizer = True
                targets.append(tg)
    return targets


def _extent(t: torch.Tensor) -> int:
    if t.is_contiguous():  # the common case, without a Python loop over the dimensions
        return (t.storage_offset() + t.numel()) * t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _put_value(values: Dict[int, torch.Tensor], old: torch.Tensor, new: torch.Tensor,
               device: torch.device) -> None:
    """Record ``new`` as the content of ``old``'s storage when ``old`` is the whole storage."""
    if not old.is_meta or old.numel() == 0:
        return
    if old.storage_offset() != 0 or not old.is_contiguous() or \
            old.untyped_storage().nbytes() != old.numel() * old.element_size():
        return  # a view into a bigger storage: not plain metadata
    values[storage_key(old)] = new.to(device)


def _known_values(meta: List[torch.Tensor], sharded: List[Tuple[str, nn.Module]],
                  device: torch.device, skip: Set[int] = frozenset()) -> Dict[int, torch.Tensor]:
    """storage key -> real tensor with the storage's content, for metadata we can produce.
    ``meta``: the meta tensors whose recorded values count; only a contiguous tensor at
    offset 0 of its storage can give one (the caller may pass just those). ``skip``: ids of
    wrappers whose TBE metadata the caller gives (the CUDA layout's)."""
    from .tbe import rebuild_tbe_metadata
    from .values import torchrec_known_values

    values: Dict[int, torch.Tensor] = {}

    def put(old: torch.Tensor, new: torch.Tensor) -> None:
        _put_value(values, old, new, device)

    for _, sm in sharded:
        for w in _wrappers(sm):
            if id(w) in skip:
                continue
            own = _own_tensors(w._emb_module)
            if not any(_value_unknown(t) for t in own.values()):
                continue  # shard_on_meta recorded every value (~9 µs per table saved)
            for name, new in rebuild_tbe_metadata(w, device).items():
                put(own[name], new)
        for old, new in torchrec_known_values(sm):
            put(old, new)
    for t in meta:
        v = recorded_value(t)
        if v is not None:
            put(t, v)
    return values


def _value_unknown(t: torch.Tensor) -> bool:
    """A non-empty integer meta tensor with no recorded value: TBE metadata (offsets,
    placements, counters) only fbgemm's constructor can tell. Floating ones are tables,
    optimizer state or zeros; they need no rebuild."""
    return t.is_meta and t.numel() > 0 and not t.is_floating_point() \
        and recorded_value(t) is None


def _own_tensors(m: nn.Module) -> Dict[str, torch.Tensor]:
    out = {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}
    out.update({k: v for k, v in m._parameters.items() if v is not None})
    out.update({k: v for k, v in m._buffers.items() if v is not None})
    return out


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
    if _uses_torchrec():
        check_versions()
    root = root_of(model)
    graph = scan(model)
    if sharded is None:
        sharded = sharded_modules(root)
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
            f"this model's TorchRec tables are laid out for fbgemm's CPU kernels; materialize "
            f"it with device='cpu' (for GPUs shard it with metamat.shard_on_meta(..., "
            f"compute_device='cuda'))"
        )
    warnings: List[str] = []
    refill: Set[int] = set()
    names: Set[str] = set()
    optim_names: Set[str] = set()
    targets = _table_targets(sharded, init, warnings, loading, refill, names)
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
    targets += _optimizer_targets(model, loading, optim_names)
    meta = graph.meta_tensors()  # ~25 tensor objects per table: listed once

    storages: Dict[int, StorageGroup] = {}
    in_tuples = graph.tuple_held()
    starts = []  # contiguous tensors at offset 0: the only ones a recorded value can fill
    for t in meta:  # one pass (~5 tensors per table, nearly all views into a TBE's storage)
        if in_tuples and id(t) in in_tuples:
            raise UnsupportedError(
                f"meta tensor {graph.tuple_path(t)} is held in an immutable container; "
                "metamat cannot swap it"
            )
        st = t.untyped_storage()
        k = st._cdata  # storage_key(t)
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

        tbes = cuda_tbes(_named_wrappers(sharded))
    values = _known_values(starts, sharded, device, skip={id(t.wrapper) for t in tbes})
    if cuda:
        plan_cuda_storages(tbes, storages, lambda old, new: _put_value(values, old, new, device))
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
                        optim_names, cuda_tbes=tbes, emulated=emulated)
