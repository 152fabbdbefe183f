"""Find every tensor a model can reach, and every place (slot) that holds it.

``named_parameters()`` misses most of a sharded TorchRec model: lookups sit in plain Python
lists, fbgemm keeps tensors as plain attributes, the fused optimizer keys its state by
ShardedTensor, ShardedTensors hold Shards (``__slots__`` dataclasses). ``scan`` walks the
object graph instead: modules, optimizers, containers, tensors' own ``__dict__``/slots,
and objects of torch/torchrec/fbgemm classes. For each object it records the slots that
refer to it, so the register stage can swap in a replacement everywhere at once. What can
hold nothing to swap is not recorded: containers of leaves (str, int, ...), and torch's
shard metadata, which is only searched for the devices its placements name. The hook
registries of modules and optimizers are not read at all (they hold code, not state). What the
walk reads of each type is :mod:`.graph_kinds`; the walk itself runs in C (:func:`scan`), its
specification here (:func:`scan_reference`).
"""
from __future__ import annotations

from operator import itemgetter
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from .graph_kinds import (CONTAINERS, HOOK_ATTRS, HOOK_OWNERS, KIND, METADATA_SKIP, children,
                          holds_nothing, is_wrapper_tensor, kind_of, slot_names, type_is,
                          walked_later)

__all__ = ["Slot", "Graph", "scan", "scan_reference", "is_wrapper_tensor", "slot_names"]

# The former names of the kind table and function (tests read and reset them), and the types
# walked one at a time, looked up here when a walk starts (tests put their own in).
_KIND, _kind_of = KIND, kind_of
_walked_later = walked_later

# tensor type -> is_wrapper_tensor of its instances (ShardedTensor, DTensor: True; plain
# tensors, parameters, TorchRec's TableBatchedEmbeddingSlice: False)
_WRAPPER_TYPES: Dict[type, bool] = {torch.Tensor: False, nn.Parameter: False}


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

    def tuple_swappable(self, obj: Any) -> bool:
        """Every tuple holding ``obj`` is a plain tuple held only in mutable slots, so the
        register stage can put a new tuple there (TorchRec's ``(tbe, index tensor)`` pairs)."""
        for s in self.slots.get(id(obj)) or ():
            if s.kind != "tuple":
                continue
            outer = self.slots.get(id(s.holder)) or ()
            if type(s.holder) is not tuple or not outer or \
                    any(o.kind == "tuple" for o in outer):
                return False
        return True

    def of_type(self, cls: type) -> List[Any]:
        return [o for o in self.objects.values() if type_is(o, cls)]

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
        if type_is(r, torch.Tensor):
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
    core().scan_graph(list(roots), rec, g._tensors, KIND, kind_of, slot_names, Slot,
                      torch.Tensor, torch.device, g.device_refs, HOOK_OWNERS, HOOK_ATTRS,
                      METADATA_SKIP, _walked_later())
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
    of_kind, kinds = kind_of, KIND  # locals: read once per reference
    searched: set = set()  # ids of metadata objects (and their containers) searched

    def visit(obj: Any, kind: str, key: Any, child: Any, in_metadata: bool) -> None:
        k = kinds.get(type(child))
        if k is None:
            k = of_kind(child)
        if not k:
            if kind == "attr" and (type(child) is torch.device
                                   or type(child) is str and child == "meta"):
                g.device_refs.append((obj, key))
            return
        if k == 3 or (in_metadata and k == 1 and type_is(child, CONTAINERS)):
            if id(child) not in searched:  # metadata: devices only, now, not recorded
                searched.add(id(child))
                for ck, ckey, c in children(child, METADATA_SKIP.get(type(child), ())):
                    visit(child, ck, ckey, c, True)
            return
        if k == 1 and type_is(child, CONTAINERS) and holds_nothing(child):
            return  # nothing in it to swap: not recorded
        cid = id(child)
        slots[cid].append(Slot(obj, kind, key))
        if cid not in objects:
            objects[cid] = child
            if k == 2:
                tensors.append(child)
            else:
                if type_is(child, torch.Tensor):
                    tensors.append(child)
                (later if later_types and type_is(child, later_types) else queue).append(child)

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
        for kind, key, child in children(obj):
            visit(obj, kind, key, child, False)
    return g
