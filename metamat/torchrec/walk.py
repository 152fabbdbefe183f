"""Plan stage: find every meta tensor of a model and say how each byte gets its value.

Nothing is allocated here. The result is a ``Plan``:

* ``targets``: one ``metamat.plan.Target`` per local block of a checkpointable tensor:
  embedding table shards (fqn = ``state_dict`` key, global offsets from the sharding),
  fused-optimizer state (fqn = ``state.<param fqn>.<state name>``, the path in
  ``dmp.fused_optimizer.state_dict()``), dense parameters/buffers (fqn = state_dict key).
  ``tensor`` holds a meta view until the allocate stage swaps in the real one.
* ``storages``: every meta storage reachable from the model, with how it is initialised:
  ``targets`` (covered by targets, gaps zeroed), ``values`` (TBE/TorchRec metadata with
  known values), ``dense`` (module ``reset_parameters``), ``zeros``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..plan import Target
from ..spec import Dist, Zeros
from .compat import UnsupportedError, check_versions
from .graph import Graph, scan
from .initspec import default_table_dist, dist_from_init_fn, match_init

__all__ = ["Plan", "StorageGroup", "DenseModule", "build_plan", "storage_key", "plan_targets"]

_META = torch.device("meta")


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (works on meta)."""
    return t.untyped_storage()._cdata


@dataclasses.dataclass
class StorageGroup:
    """One meta storage and the graph tensors that view it."""

    key: int
    nbytes: int
    tensors: List[torch.Tensor]
    kind: str = "zeros"  # "targets" | "values" | "dense" | "zeros"
    value: Optional[torch.Tensor] = None  # for kind == "values": the whole storage's content
    where: str = ""


@dataclasses.dataclass
class DenseModule:
    """A plain module with meta parameters/buffers initialised by ``reset_parameters``."""

    fqn: str
    module: nn.Module
    names: List[str]  # own parameter/buffer names that are meta
    reset: bool  # call reset_parameters()


@dataclasses.dataclass
class Plan:
    device: torch.device
    graph: Graph
    targets: List[Target]
    storages: Dict[int, StorageGroup]
    dense: List[DenseModule]
    warnings: List[str] = dataclasses.field(default_factory=list)
    sharded: List[Tuple[str, nn.Module]] = dataclasses.field(default_factory=list)
    optimizer_fqns: set = dataclasses.field(default_factory=set)  # fqns of optimizer-state targets

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())


def _unwrap(m: Any) -> Any:
    while hasattr(m, "module") and isinstance(m, torch.nn.parallel.DistributedDataParallel):
        m = m.module
    return m


def _uses_torchrec() -> bool:
    # A model can only hold TorchRec modules if torchrec was imported.
    import sys

    return "torchrec" in sys.modules


def _sharded_modules(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    if not _uses_torchrec():
        return []
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
    from torchrec.distributed.types import ShardedModule

    out = []
    for name, m in root.named_modules():
        if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            out.append((name, m))
        elif isinstance(m, ShardedModule):
            if any(p.device.type == "meta" for p in _tensors_of(m)):
                raise UnsupportedError(
                    f"{name or '<root>'}: sharded module type {type(m).__name__} is not supported "
                    "(supported: ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)"
                )
    return out


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
        gshape = tuple(value.size())
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


def _table_targets(model: nn.Module, sharded: List[Tuple[str, nn.Module]],
                   init: Optional[Mapping[str, Dist]], warnings: List[str]) -> List[Target]:
    configs: Dict[str, Dict[str, Any]] = {name: _table_configs(sm) for name, sm in sharded}
    targets = []
    for name, sm in sharded:
        prefix = f"{name}." if name else ""
        warned = set()
        sd = sm.state_dict(prefix=prefix)
        # DMP(device=meta) still builds DATA_PARALLEL tables on CPU with torch's RNG; refill
        # them (in place) when the module's other tables are on meta, so every table gets
        # plan-invariant values.
        any_meta = any(b[0].device.type == "meta" for v in sd.values() if isinstance(v, torch.Tensor)
                       for b in _local_blocks(v))
        for key, value in sd.items():
            tn = _table_name_from_key(key)
            if tn is None:
                continue
            table = tn[1]
            cfg = configs[name].get(table)
            if cfg is None:
                continue
            dist = match_init(init, table, key)
            init_fn = None
            if dist is None:
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
                if local.numel() == 0 or (local.device.type != "meta" and not any_meta):
                    continue
                targets.append(Target(
                    fqn=key, key=table, global_shape=gshape, offsets=offsets,
                    local_shape=tuple(local.shape), dtype=local.dtype, dist=dist,
                    tensor=local, init_fn=init_fn,
                ))
    return targets


def _optimizer_targets(model: nn.Module, real: bool = False) -> List[Target]:
    """Targets of the fused optimizer's state: the meta blocks, or (``real``) the blocks
    already on a real device (an eager model, loaded in place)."""
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
            for local, offsets, gshape in _local_blocks(value):
                if local.numel() == 0 or (local.device.type == "meta") == real:
                    continue
                targets.append(Target(
                    fqn=f"state.{pfqn}.{sname}", key=sname, global_shape=gshape,
                    offsets=offsets, local_shape=tuple(local.shape), dtype=local.dtype,
                    dist=Zeros(), tensor=local,
                ))
    return targets


def _dense_modules(root: nn.Module, init: Optional[Mapping[str, Dist]],
                   known: Optional[set] = None) -> Tuple[List[DenseModule], List[Target]]:
    """Plain modules with meta params/buffers. Buffers whose storage is in ``known`` (values
    recorded at construction) are left to the values path; an integer buffer with no known
    value in a module without ``reset_parameters`` is an error (zeros would be wrong)."""
    check_values = known is not None
    known = known or set()
    if _uses_torchrec():
        from torchrec.distributed.types import ShardedModule
    else:
        class ShardedModule:  # noqa: N801 - nothing is an instance
            pass

    dense, targets = [], []
    skip: List[str] = []
    for name, m in root.named_modules():
        if any(s == "" or name == s or name.startswith(s + ".") for s in skip):
            continue
        if isinstance(m, ShardedModule):
            skip.append(name)
            continue
        names = [k for k, v in m._parameters.items() if v is not None and v.device.type == "meta"]
        names += [k for k, v in m._buffers.items() if v is not None and v.device.type == "meta"
                  and storage_key(v) not in known]
        if not names:
            continue
        prefix = f"{name}." if name else ""
        has_reset = callable(getattr(m, "reset_parameters", None))
        needs_reset = False
        for k in names:
            t = m._parameters.get(k)
            is_param = t is not None
            if t is None:
                t = m._buffers[k]
            dist = match_init(init, prefix + k)
            if dist is None and not is_param and not has_reset and not t.is_floating_point() \
                    and t.numel() > 0 and check_values:
                raise UnsupportedError(
                    f"buffer {prefix + k!r} ({t.dtype}) is on meta with no known value and "
                    f"{type(m).__name__} has no reset_parameters(); create it on a real device "
                    "or build the model inside metamat.shard_on_meta"
                )
            if dist is None and (is_param or has_reset):
                needs_reset = True
                if not has_reset:
                    raise UnsupportedError(
                        f"parameter {prefix + k!r} is on meta and {type(m).__name__} has no "
                        "reset_parameters(); name it in init= to give it a distribution"
                    )
            if t.dim() > 2:
                if dist is not None:
                    raise UnsupportedError(
                        f"{prefix + k!r}: init= distributions need a 1-D or 2-D tensor, "
                        f"got shape {tuple(t.shape)}"
                    )
            if not is_param and k in m._non_persistent_buffers_set and dist is None:
                continue  # never in a checkpoint; reset_parameters or zeros give its value
            targets.append(Target(
                fqn=prefix + k, key=prefix + k, global_shape=tuple(t.shape),
                offsets=tuple(0 for _ in t.shape), local_shape=tuple(t.shape), dtype=t.dtype,
                dist=dist, tensor=t,
            ))
        dense.append(DenseModule(prefix.rstrip("."), m, names, reset=needs_reset))
    return dense, targets


def _contiguous_range(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    if not t.is_contiguous():
        return None
    isz = t.element_size()
    return t.storage_offset() * isz, (t.storage_offset() + t.numel()) * isz


def _extent(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return t.storage_offset() * t.element_size()
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def _known_values(graph: Graph, sharded: List[Tuple[str, nn.Module]], device: torch.device
                  ) -> Dict[int, torch.Tensor]:
    """storage key -> real tensor with the storage's content, for metadata we can produce."""
    from .tbe import rebuild_tbe_metadata
    from .values import torchrec_known_values

    values: Dict[int, torch.Tensor] = {}

    def put(old: torch.Tensor, new: torch.Tensor) -> None:
        if old.device.type != "meta" or old.numel() == 0:
            return
        if old.storage_offset() != 0 or not old.is_contiguous() or \
                old.untyped_storage().nbytes() != old.numel() * old.element_size():
            return  # a view into a bigger storage: not plain metadata
        values[storage_key(old)] = new.to(device)

    for _, sm in sharded:
        for w in _wrappers(sm):
            emb = w._emb_module
            if not any(t.device.type == "meta" for t in _own_tensors(emb).values()):
                continue
            own = _own_tensors(emb)
            for name, new in rebuild_tbe_metadata(w, device).items():
                put(own[name], new)
        for old, new in torchrec_known_values(sm):
            put(old, new)
    for t in graph.meta_tensors():
        v = t.__dict__.get("_metamat_value") if hasattr(t, "__dict__") else None
        if isinstance(v, torch.Tensor):
            put(t, v)
    return values


def _own_tensors(m: nn.Module) -> Dict[str, torch.Tensor]:
    out = {k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)}
    out.update({k: v for k, v in m._parameters.items() if v is not None})
    out.update({k: v for k, v in m._buffers.items() if v is not None})
    return out


def plan_targets(model: nn.Module, init: Optional[Mapping[str, Dist]] = None) -> List[Target]:
    """Targets (fqn, global shape, offsets, local shape, dist) of every meta tensor that a
    checkpoint holds: embedding table shards, fused optimizer state, dense params/buffers.
    ``tensor`` fields are meta views. Allocates nothing.
    """
    return build_plan(model, torch.device("cpu"), init, with_values=False).targets


def build_plan(model: nn.Module, device: torch.device, init: Optional[Mapping[str, Dist]] = None,
               *, with_values: bool = True) -> Plan:
    """Validate ``model`` and plan its materialization on ``device``. Allocates no model
    memory (TBE metadata is rebuilt on ``device`` with floating storages kept on meta).

    Raises:
        UnsupportedError: unsupported versions, kernels, module types, or a meta tensor
            whose value cannot be determined.
    """
    if _uses_torchrec():
        check_versions()
    root = model.module if hasattr(model, "_dmp_wrapped_module") else model
    graph = scan(model)
    sharded = _sharded_modules(root)
    if sharded and device.type != "cpu" and with_values:
        # A TBE sharded on meta was laid out for fbgemm's CPU kernels (HOST placement);
        # moving that layout to another device would give wrong lookups.
        raise UnsupportedError(
            f"materializing TorchRec embedding kernels on {device} is not supported yet "
            "(tables sharded on meta use fbgemm's CPU layout); pass device='cpu'"
        )
    warnings: List[str] = []
    targets = _table_targets(root, sharded, init, warnings)
    opt_targets = _optimizer_targets(model)
    targets += opt_targets
    values = _known_values(graph, sharded, device) if with_values else {}
    dense, dense_targets = _dense_modules(root, init, set(values) if with_values else None)
    targets += dense_targets

    for p in graph.meta_tensors():
        for slot in graph.slots[id(p)]:
            if slot.kind == "tuple":
                raise UnsupportedError(
                    f"meta tensor {graph.path(p)} is held in an immutable container; "
                    "metamat cannot swap it"
                )

    storages: Dict[int, StorageGroup] = {}
    for t in graph.meta_tensors():
        k = storage_key(t)
        g = storages.get(k)
        if g is None:
            g = storages[k] = StorageGroup(k, t.untyped_storage().nbytes(), [], where=graph.path(t))
        g.tensors.append(t)
        g.nbytes = max(g.nbytes, _extent(t))
    for tg in targets:
        if tg.tensor.device.type != "meta":
            continue  # a real table refilled in place
        k = storage_key(tg.tensor)
        if k not in storages:  # reachable only through a state_dict view: still needs memory
            storages[k] = StorageGroup(k, tg.tensor.untyped_storage().nbytes(), [], where=tg.fqn)
    dense_keys = {storage_key(m._parameters.get(n) if m._parameters.get(n) is not None else m._buffers[n])
                  for d in dense for m in [d.module] for n in d.names}
    for tg in targets:
        k = storage_key(tg.tensor)
        if k in dense_keys or tg.tensor.device.type != "meta":
            continue
        if _contiguous_range(tg.tensor) is None:
            raise UnsupportedError(f"{tg.fqn}: local block is not contiguous in its storage")
        storages[k].kind = "targets"
    for k in dense_keys:
        storages[k].kind = "dense"

    if with_values:
        for k, v in values.items():
            g = storages.get(k)
            if g is not None and g.kind == "zeros":
                g.kind, g.value = "values", v
        for g in storages.values():
            if g.kind != "zeros" or g.nbytes == 0:
                continue
            if any(not t.is_floating_point() for t in g.tensors):
                raise UnsupportedError(
                    f"meta tensor {g.where} ({g.tensors[0].dtype}, shape "
                    f"{tuple(g.tensors[0].shape)}) holds metadata metamat cannot compute; "
                    "build the model with metamat.shard_on_meta"
                )
    return Plan(device, graph, targets, storages, dense, warnings, sharded,
                {t.fqn for t in opt_targets})
