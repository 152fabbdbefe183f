"""Find every tensor a model can reach, and every place (slot) that holds it.

``named_parameters()`` misses most of a sharded TorchRec model: lookups sit in plain Python
lists, fbgemm keeps tensors as plain attributes, the fused optimizer keys its state by
ShardedTensor, ShardedTensors hold Shards (``__slots__`` dataclasses). ``scan`` walks the
object graph instead: modules, optimizers, containers, tensors' own ``__dict__``/slots,
and objects of torch/torchrec/fbgemm classes. For each object it records the slots that
refer to it, so the register stage can swap in a replacement everywhere at once. What can
hold nothing to swap is not recorded: containers of leaves (str, int, ...), and torch's
shard metadata, which is only searched for the devices its placements name. The hook
registries of modules and optimizers are not read at all (they hold code, not state).
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from operator import itemgetter
import types
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from ..torch_upstream import METADATA_CLASSES, MODULE_HOOK_ATTRS, OPTIMIZER_HOOK_ATTRS
from .fastbuild import _STM_FIELDS

__all__ = ["Slot", "Graph", "scan", "scan_reference", "is_wrapper_tensor"]

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


class Slot(tuple):
    """One reference to an object: ``holder`` refers to it through ``kind``/``key``.

    kind: "attr" (``holder.__dict__[key]``), "slot" (``__slots__`` attribute), "item"
    (``holder[key]`` of a dict or list), "dictkey" (a key of dict ``holder``), "tuple"
    (element ``key`` of a tuple: immutable, cannot be swapped).

    A tuple ``(holder, kind, key)``: scan builds one per recorded reference (~43 per table of a
    sharded model), and the C walk makes them without running Python code.
    """

    __slots__ = ()

    def __new__(cls, holder: Any, kind: str, key: Any) -> "Slot":
        return tuple.__new__(cls, (holder, kind, key))

    holder = property(itemgetter(0))
    kind = property(itemgetter(1))
    key = property(itemgetter(2))

    def __repr__(self) -> str:
        return f"Slot({type(self.holder).__name__}, {self.kind!r}, {self.key!r})"

    def set(self, new: Any) -> None:
        """Make this slot refer to ``new``."""
        holder, kind, key = self
        if kind == "attr":
            holder.__dict__[key] = new
        elif kind == "slot":
            object.__setattr__(holder, key, new)
        elif kind == "item":
            holder[key] = new
        elif kind == "dictkey":
            items = list(holder.items())
            holder.clear()
            for k, v in items:
                holder[new if k is key else k] = v
        else:
            raise TypeError(f"cannot replace an element of an immutable {type(holder).__name__}")


# torch's shard metadata (~40 objects per table of a sharded model: a ShardedTensor's
# metadata, its sharding spec, their ShardMetadata lists, offsets and sizes) holds no tensor,
# but its placements name the device. The walk searches it for device attributes only and
# does not record it (kind 3): it was more than half of the objects recorded.
_METADATA_TYPES = frozenset(METADATA_CLASSES)  # torch's, declared in torch_upstream
# Fields of that metadata which hold no device: offsets and sizes (lists of ints), the global
# size and tensor properties, a spec's dim, a placement's worker name and rank. The search
# leaves them unread (~12 µs per table at 10k tables: each read was a cache miss); a field a
# newer torch adds is still searched. Type -> fields, filled as `_kind_of` meets the types.
_METADATA_LEAF_FIELDS = {
    "torch.distributed._shard.metadata.ShardMetadata": frozenset({"shard_offsets",
                                                                  "shard_sizes"}),
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata":
        frozenset({"size", "tensor_properties"}),
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec":
        frozenset({"dim"}),
    "torch.distributed.remote_device._remote_device": frozenset({"_worker_name", "_rank"}),
}
_METADATA_SKIP: Dict[type, frozenset] = {}
# Metadata dataclasses whose fields, as this torch defines them, are all leaves (dtype, layout,
# flags): not even searched (5 per table). Another field set (a newer torch) is searched.
_LEAF_DATACLASSES = {
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties":
        frozenset(_STM_FIELDS["TensorProperties"]),  # the fields fastbuild copies too
}
_CONTAINERS = (dict, list, tuple, set, frozenset)

# The hook registries of modules and optimizers hold code, not state: functions and bound
# methods (leaves to the walk) or torch's wrappers of them (`_WrappedHook`, which was walked).
# They are skipped by name, unread: ~13 containers per table of a sharded model (a module and
# a fused optimizer per table), each a cache miss at 10k tables. A hook object holding a meta
# tensor is therefore not found.
_HOOK_OWNERS = (nn.Module, torch.optim.Optimizer)
_HOOK_ATTRS = frozenset(MODULE_HOOK_ATTRS + OPTIMIZER_HOOK_ATTRS)  # declared in torch_upstream


def _walked_later() -> Tuple[type, ...]:
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


# tensor type -> is_wrapper_tensor of its instances (ShardedTensor, DTensor: True; plain
# tensors, parameters, TorchRec's TableBatchedEmbeddingSlice: False)
_WRAPPER_TYPES: Dict[type, bool] = {torch.Tensor: False, nn.Parameter: False}

_SLOT_NAMES: Dict[type, Tuple[str, ...]] = {}


def slot_names(obj: Any) -> Tuple[str, ...]:
    cls = type(obj)
    names = _SLOT_NAMES.get(cls)
    if names is None:
        names = _SLOT_NAMES[cls] = tuple(
            name for c in cls.__mro__ for name in
            ((c.__dict__.get("__slots__", ()),) if _is(c.__dict__.get("__slots__"), str)
             else c.__dict__.get("__slots__", ()))
            if _is(name, str) and name not in ("__dict__", "__weakref__"))
    return names


def _is(obj: Any, types_: Any) -> bool:
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
_KIND: Dict[type, int] = {}


def _kind_of(obj: Any) -> int:
    cls = type(obj)
    k = _KIND.get(cls)
    if k is None:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if issubclass(cls, _LEAF_TYPES) or cls.__name__ in _UNWALKED_TYPES \
                or _leaf_dataclass(cls, name):
            k = 0
        elif name in _METADATA_TYPES:
            k = 3
            if name in _METADATA_LEAF_FIELDS:
                _METADATA_SKIP[cls] = _METADATA_LEAF_FIELDS[name]
        elif cls is torch.Tensor:
            k = 2
        elif issubclass(cls, (torch.Tensor,) + _CONTAINERS) or _walkable_object(obj):
            k = 1  # tensor subclasses too: wrapper tensors (ShardedTensor) and slices alike
        else:
            k = 0
        _KIND[cls] = k
    return k


def _leaf_dataclass(cls: type, name: str) -> bool:
    fields = _LEAF_DATACLASSES.get(name)
    return fields is not None and dataclasses.is_dataclass(cls) and \
        fields == frozenset(f.name for f in dataclasses.fields(cls))


def _holds_nothing(container: Any) -> bool:
    """A container whose every element (and key) is a leaf: nothing in it can be swapped
    (``feature_names``, ``ranks``, empty buffer dicts: ~25 per table of a sharded model)."""
    is_dict = _is(container, dict)
    items = [(k, v) for k, v in list(container.items())] if is_dict else container
    for item in items:
        for v in (item if is_dict else (item,)):
            k = _KIND.get(type(v))
            if k is None:
                k = _kind_of(v)
            if k:
                return False
    return True


def _children(obj: Any, skip: frozenset = frozenset()) -> Iterator[Tuple[str, Any, Any]]:
    """Yield (kind, key, child) for every reference held by ``obj`` (but its attributes and
    slots named in ``skip``)."""
    if _is(obj, dict):
        for k, v in list(obj.items()):
            if _is(k, torch.Tensor):
                yield "dictkey", k, k
            yield "item", k, v
        return
    if _is(obj, list):
        for i, v in enumerate(list(obj)):
            yield "item", i, v
        return
    if _is(obj, tuple):
        for i, v in enumerate(tuple(obj)):
            yield "tuple", i, v
        return
    if _is(obj, (set, frozenset)):
        for v in tuple(obj):
            yield "tuple", None, v
        return
    d = getattr(obj, "__dict__", None)
    if _is(d, dict):
        hooks = _is(obj, _HOOK_OWNERS)
        for k, v in list(d.items()):
            if not (type(k) is str and (hooks and k in _HOOK_ATTRS or k in skip)):  # as in C
                yield "attr", k, v
    for name in slot_names(obj):
        if name in skip:
            continue
        try:
            v = object.__getattribute__(obj, name)
        except AttributeError:
            continue
        yield "slot", name, v


class _RecordObjects(Mapping):
    """``Graph.objects`` of a C walk: id -> object, read from its record (the C walk keeps
    what it finds in a ``_C.GraphRecord``: filling dicts took ~45% of its time)."""

    def __init__(self, rec: Any) -> None:
        self._rec = rec

    def __getitem__(self, i: int) -> Any:
        if not isinstance(i, int):
            raise KeyError(i)
        return self._rec.object(i)

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and self._rec.has(i)

    def __iter__(self) -> Iterator[int]:
        return iter([id(o) for o in self._rec.objects()])

    def __len__(self) -> int:
        return len(self._rec)

    def values(self) -> List[Any]:  # type: ignore[override]
        return self._rec.objects()

    def items(self) -> List[Tuple[int, Any]]:  # type: ignore[override]
        return [(id(o), o) for o in self._rec.objects()]


class _RecordSlots(Mapping):
    """``Graph.slots`` of a C walk: id -> a new list of its Slots; like the Python walk's
    defaultdict, an id without slots gives [] (and is not a key)."""

    def __init__(self, rec: Any) -> None:
        self._rec = rec

    def __getitem__(self, i: int) -> List[Slot]:
        return self._rec.slots(i) if isinstance(i, int) else []

    def get(self, i: int, default: Any = None) -> Any:
        return self._rec.slots(i) if i in self else default

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and self._rec.has_slots(i)

    def __iter__(self) -> Iterator[int]:
        return iter(self._rec.ids_with_slots())

    def __len__(self) -> int:
        return self._rec.with_slots()


class Graph:
    """Result of ``scan``: objects by id, their slots, and a readable path to each.

    ``objects`` (id -> object) and ``slots`` (id -> list of Slot) are dicts when the Python
    walk made the graph and read-only mappings over the C walk's record otherwise. The record
    holds strong references that Python's collector cannot see: never store a Graph where its
    model can reach it.
    """

    def __init__(self) -> None:
        self.objects: Mapping = {}
        self.slots: Mapping = defaultdict(list)
        self._root_names: Dict[int, str] = {}
        self._paths: Dict[int, str] = {}
        self._tensors: List[torch.Tensor] = []  # every tensor object reached, in scan order
        self._meta = None  # meta_tensors(), once listed
        # (holder, name) of every attribute that holds a torch.device or the str "meta": the
        # register stage renames meta devices without walking every object again
        self.device_refs: List[Tuple[Any, str]] = []

    @property
    def paths(self) -> Dict[int, str]:
        """id -> readable path of every object (computed on first use)."""
        for i in self.objects:
            self._path_of(i)
        return self._paths

    def _path_of(self, i: int) -> str:
        p = self._paths.get(i)
        if p is not None:
            return p
        chain = []
        first = {}
        # the first slot of a non-root object is the reference it was first reached through
        while i not in self._paths and i not in self._root_names:
            slot = first[i] = self._first_slot(i)
            if slot is None:
                break
            chain.append(i)
            i = id(slot.holder)
        p = self._paths.get(i) or self._root_names.get(i, "?")
        for c in reversed(chain):
            _, kind, key = first[c]
            name = key if isinstance(key, (str, int)) else type(key).__name__
            base = "" if p == "<model>" else p
            if kind in ("item", "tuple") and isinstance(key, int):
                p = f"{base}[{key}]"
            else:
                p = f"{base}.{name}" if base else str(name)
            self._paths[c] = p
        return p

    def _first_slot(self, i: int):
        if isinstance(self.slots, _RecordSlots):
            return self.slots._rec.first_slot(i)
        v = self.slots.get(i)
        return v[0] if v else None

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every storage-backed tensor reached (wrapper tensors excluded)."""
        for obj in self._tensors:
            if not is_wrapper_tensor(obj):
                yield obj

    def meta_tensors(self) -> List[torch.Tensor]:
        """Every storage-backed meta tensor reached (listed once: the register stage swaps
        slots, the objects listed stay meta)."""
        if self._meta is None:  # tensors() inline: ~9 tensor objects per table
            wrapper = _WRAPPER_TYPES
            meta = []
            for t in self._tensors:
                w = wrapper.get(type(t))
                if w is None:  # decided once per type: hasattr on a tensor is slow (~2 µs)
                    w = wrapper[type(t)] = is_wrapper_tensor(t)
                if not w and t.is_meta:
                    meta.append(t)
            self._meta = meta
        return self._meta

    def tuple_held(self) -> set:
        """ids of the objects held in an immutable container (a slot of kind "tuple")."""
        if isinstance(self.slots, _RecordSlots):
            return self.slots._rec.tuple_held()
        return {i for i, v in self.slots.items() if any(s.kind == "tuple" for s in v)}

    def of_type(self, cls: type) -> List[Any]:
        return [o for o in self.objects.values() if _is(o, cls)]

    def path(self, obj: Any) -> str:
        i = id(obj)
        if i not in self.objects:
            return "?"
        return self._path_of(i)

    def tuple_path(self, obj: Any) -> str:
        """The path of ``obj`` through the first immutable container that holds it (its
        ``path`` is where the walk first reached it, which may be a mutable holder)."""
        for s in self.slots.get(id(obj)) or ():
            if s.kind == "tuple":
                base = self.path(s.holder)
                return f"{'' if base == '<model>' else base}[{s.key}]"
        return self.path(obj)


def _start(roots: Tuple[Any, ...]) -> Graph:
    g = Graph()
    for i, r in enumerate(roots):
        g.objects[id(r)] = r
        if _is(r, torch.Tensor):
            g._tensors.append(r)
        g._root_names[id(r)] = "<model>" if i == 0 else f"<root{i}>"
    return g


def scan(root: Any, *extra_roots: Any) -> Graph:
    """Walk the object graph from ``root`` and record every tensor, module and slot.

    The walk runs in C (``_C.scan_graph``, ~10x faster: a sharded model holds ~140
    references per table) and keeps what it finds in a ``_C.GraphRecord``, which the
    graph's ``objects`` and ``slots`` read; :func:`scan_reference` is the same walk in Python,
    its specification. It goes breadth-first, TorchRec's sharded modules one at a time: close
    to the order the objects were made in (csrc/python/graph_walk.h says why).

    Args:
        root: usually the model (a DMP or any ``nn.Module``).
        *extra_roots: more objects to walk (e.g. an optimizer).

    Returns:
        A ``Graph``.
    """
    from ..._ext import core

    roots = (root,) + extra_roots
    g = _start(roots)
    rec = core().GraphRecord()
    core().scan_graph(list(roots), rec, g._tensors, _KIND, _kind_of, slot_names, Slot,
                      torch.Tensor, torch.device, g.device_refs, _HOOK_OWNERS, _HOOK_ATTRS,
                      _METADATA_SKIP, _walked_later())
    g.objects, g.slots = _RecordObjects(rec), _RecordSlots(rec)
    return g


def scan_reference(root: Any, *extra_roots: Any) -> Graph:
    """``scan`` in Python: the specification the C walk is tested against."""
    roots = (root,) + extra_roots
    g = _start(roots)
    objects, slots, tensors = g.objects, g.slots, g._tensors
    # breadth-first, sharded modules one at a time: the C walk's order (see its comment)
    queue: List[Any] = list(roots)
    later: List[Any] = []
    later_types = _walked_later()
    kind_of, kinds = _kind_of, _KIND
    searched: set = set()  # ids of metadata objects (and their containers) searched

    def visit(obj: Any, kind: str, key: Any, child: Any, in_metadata: bool) -> None:
        k = kinds.get(type(child))
        if k is None:
            k = kind_of(child)
        if not k:
            if kind == "attr" and (type(child) is torch.device
                                   or type(child) is str and child == "meta"):
                g.device_refs.append((obj, key))
            return
        if k == 3 or (in_metadata and k == 1 and _is(child, _CONTAINERS)):
            if id(child) not in searched:  # metadata: devices only, now, not recorded
                searched.add(id(child))
                for ck, ckey, c in _children(child, _METADATA_SKIP.get(type(child), ())):
                    visit(child, ck, ckey, c, True)
            return
        if k == 1 and _is(child, _CONTAINERS) and _holds_nothing(child):
            return  # nothing in it to swap: not recorded
        cid = id(child)
        slots[cid].append(Slot(obj, kind, key))
        if cid not in objects:
            objects[cid] = child
            if k == 2:
                tensors.append(child)
            else:
                if _is(child, torch.Tensor):
                    tensors.append(child)
                (later if later_types and _is(child, later_types) else queue).append(child)

    head = nxt = 0
    while True:  # both queues grow while walked; `later` is read when `queue` has run empty
        if head < len(queue):
            obj, head = queue[head], head + 1
        elif nxt < len(later):
            obj, nxt = later[nxt], nxt + 1
        else:
            break
        if type(obj) is torch.Tensor:
            continue  # plain tensors hold nothing else worth walking
        for kind, key, child in _children(obj):
            visit(obj, kind, key, child, False)
    return g
