"""What the object-graph walk (:mod:`.graph`) reads: each type's kind (a leaf, walked, a plain
tensor, or shard metadata searched for devices only), the references an object holds, and the
types and attributes it never reads (hook registries, TorchRec's construction-time sharding
info). The C walk (``_C.scan_graph``) is given these same tables and functions.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
import types
from typing import Any, Dict, Iterator, Tuple

import torch
from torch import nn

from ..torch_upstream import METADATA_CLASSES, MODULE_HOOK_ATTRS, OPTIMIZER_HOOK_ATTRS
from .fastbuild import STM_FIELDS

__all__ = ["KIND", "kind_of", "children", "holds_nothing", "walked_later", "type_is",
           "slot_names", "is_wrapper_tensor", "CONTAINERS", "HOOK_OWNERS", "HOOK_ATTRS",
           "METADATA_SKIP"]

_WALK_MODULE_PREFIXES = ("torch", "torchrec", "fbgemm_gpu", "metamat")
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.device, torch.dtype,
               torch.Size, types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
               types.MethodType, type, range, slice,
               # shared constants and handles that hold no tensor: as walked objects they
               # cost ~20 slots per table of a sharded model (every ShardedTensor's layout,
               # memory format and process group, TorchRec's pooling/data-type enums)
               torch.layout, torch.memory_format, enum.Enum)
if torch.distributed.is_available():
    _LEAF_TYPES += (torch.distributed.ProcessGroup,)


# torch's shard metadata (~40 objects per table of a sharded model: a ShardedTensor's
# metadata, its sharding spec, their ShardMetadata lists, offsets and sizes) holds no tensor,
# but its placements name the device. The walk searches it for device attributes only and
# does not record it (kind 3): it was more than half of the objects recorded.
_METADATA_TYPES = frozenset(METADATA_CLASSES)  # torch's, declared in torch_upstream
# Fields of that metadata which hold no device: offsets and sizes (lists of ints), the global
# size and tensor properties, a spec's dim, a placement's worker name and rank. The search
# leaves them unread (~12 µs per table at 10k tables: each read was a cache miss); a field a
# newer torch adds is still searched. Type -> fields, filled as `kind_of` meets the types.
_METADATA_LEAF_FIELDS = {
    "torch.distributed._shard.metadata.ShardMetadata": frozenset({"shard_offsets",
                                                                  "shard_sizes"}),
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata":
        frozenset({"size", "tensor_properties"}),
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec":
        frozenset({"dim"}),
    "torch.distributed.remote_device._remote_device": frozenset({"_worker_name", "_rank"}),
}
METADATA_SKIP: Dict[type, frozenset] = {}
# Metadata dataclasses whose fields, as this torch defines them, are all leaves (dtype, layout,
# flags): not even searched (5 per table). Another field set (a newer torch) is searched.
_LEAF_DATACLASSES = {
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties":
        frozenset(STM_FIELDS["TensorProperties"]),  # the fields fastbuild copies too
}
CONTAINERS = (dict, list, tuple, set, frozenset)

# The hook registries of modules and optimizers hold code, not state: functions and bound
# methods (leaves to the walk) or torch's wrappers of them (`_WrappedHook`, which was walked).
# They are skipped by name, unread: ~13 containers per table of a sharded model (a module and
# a fused optimizer per table), each a cache miss at 10k tables. A hook object holding a meta
# tensor is therefore not found.
HOOK_OWNERS = (nn.Module, torch.optim.Optimizer)
HOOK_ATTRS = frozenset(MODULE_HOOK_ATTRS + OPTIMIZER_HOOK_ATTRS)  # declared in torch_upstream


def walked_later() -> Tuple[type, ...]:
    """Types whose objects the walk visits one at a time, once nothing else is queued: TorchRec's
    sharded modules (each module's objects were made together; see
    csrc/python/graph_walk.h)."""
    types_ = sys.modules.get("torchrec.distributed.types")  # a model holds none without it
    return (types_.ShardedModule,) if types_ is not None else ()


# TorchRec's EmbeddingShardingInfo keeps the *unsharded* construction-time parameter
# (`.param`, full table size). It is not model state: eager TorchRec leaves it on meta too.
# Materializing it would cost every rank a full copy of every table.
_UNWALKED_TYPES = frozenset({"EmbeddingShardingInfo"})


def is_wrapper_tensor(t: torch.Tensor) -> bool:
    """ShardedTensor/DTensor: a tensor object without storage of its own."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return False  # ~2 µs saved per tensor: a failed hasattr on a tensor is slow
    # ShardedTensor's and DTensor's (torch_upstream declares both)
    return hasattr(t, "_local_shards") or hasattr(t, "_local_tensor")


_SLOT_NAMES: Dict[type, Tuple[str, ...]] = {}


def slot_names(obj: Any) -> Tuple[str, ...]:
    cls = type(obj)
    names = _SLOT_NAMES.get(cls)
    if names is None:
        names = _SLOT_NAMES[cls] = tuple(
            name for c in cls.__mro__ for name in
            ((c.__dict__.get("__slots__", ()),) if type_is(c.__dict__.get("__slots__"), str)
             else c.__dict__.get("__slots__", ()))
            if type_is(name, str) and name not in ("__dict__", "__weakref__"))
    return names


def type_is(obj: Any, types_: Any) -> bool:
    """``isinstance(obj, types_)`` by the object's type alone. isinstance also asks the
    object's ``__class__``, which may be a property: code that runs in the middle of the walk
    (and may free what it holds: the C walk holds what it reads), or a claim to be
    ``torch.Tensor`` that the object's attributes do not back. The walk goes by types."""
    return issubclass(type(obj), types_)


def _walkable_object(obj: Any) -> bool:
    cls = type(obj)
    if issubclass(cls, (nn.Module, torch.optim.Optimizer)):
        return True
    mod = cls.__module__ or ""
    return (isinstance(mod, str) and mod.split(".")[0] in _WALK_MODULE_PREFIXES) \
        or dataclasses.is_dataclass(cls)


# type -> 0: not recorded (leaf), 1: recorded and walked (a container of leaves only is
# not recorded), 2: a plain tensor (recorded, its contents not walked), 3: shard metadata (not
# recorded, searched for device attributes). The answer depends on the type alone, so scan
# decides once per type.
KIND: Dict[type, int] = {}


def kind_of(obj: Any) -> int:
    cls = type(obj)
    k = KIND.get(cls)
    if k is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if issubclass(cls, _LEAF_TYPES) or cls.__name__ in _UNWALKED_TYPES \
                or _leaf_dataclass(cls, name):
            k = 0
        elif name in _METADATA_TYPES:
            k = 3
            if name in _METADATA_LEAF_FIELDS:
                METADATA_SKIP[cls] = _METADATA_LEAF_FIELDS[name]
        elif cls is torch.Tensor:
            k = 2
        elif issubclass(cls, (torch.Tensor,) + CONTAINERS) or _walkable_object(obj):
            k = 1  # tensor subclasses too: wrapper tensors (ShardedTensor) and slices alike
        else:
            k = 0
        KIND[cls] = k
    return k


def _leaf_dataclass(cls: type, name: str) -> bool:
    fields = _LEAF_DATACLASSES.get(name)
    return fields is not None and dataclasses.is_dataclass(cls) and \
        fields == frozenset(f.name for f in dataclasses.fields(cls))


def holds_nothing(container: Any) -> bool:
    """A container whose every element (and key) is a leaf: nothing in it can be swapped
    (``feature_names``, ``ranks``, empty buffer dicts: ~25 per table of a sharded model)."""
    is_dict = type_is(container, dict)
    items = [(k, v) for k, v in list(container.items())] if is_dict else container
    for item in items:
        for v in (item if is_dict else (item,)):
            k = KIND.get(type(v))
            if k is None:
                k = kind_of(v)
            if k:
                return False
    return True


def children(obj: Any, skip: frozenset = frozenset()) -> Iterator[Tuple[str, Any, Any]]:
    """Yield (kind, key, child) for every reference held by ``obj`` (but its attributes and
    slots named in ``skip``)."""
    if type_is(obj, dict):
        for k, v in list(obj.items()):
            if type_is(k, torch.Tensor):
                yield "dictkey", k, k
            yield "item", k, v
        return
    if type_is(obj, list):
        for i, v in enumerate(list(obj)):
            yield "item", i, v
        return
    if type_is(obj, tuple):
        for i, v in enumerate(tuple(obj)):
            yield "tuple", i, v
        return
    if type_is(obj, (set, frozenset)):
        for v in tuple(obj):
            yield "tuple", None, v
        return
    d = getattr(obj, "__dict__", None)
    if type_is(d, dict):
        hooks = type_is(obj, HOOK_OWNERS)
        for k, v in list(d.items()):
            if not (type(k) is str and (hooks and k in HOOK_ATTRS or k in skip)):  # as in C
                yield "attr", k, v
    for name in slot_names(obj):
        if name in skip:
            continue
        try:
            v = object.__getattribute__(obj, name)
        except AttributeError:
            continue
        yield "slot", name, v
