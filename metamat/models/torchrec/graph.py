"""Find every tensor a model can reach, and every place (slot) that holds it.

``named_parameters()`` misses most of a sharded TorchRec model: lookups sit in plain Python
lists, fbgemm keeps tensors as plain attributes, the fused optimizer keys its state by
ShardedTensor, ShardedTensors hold Shards (``__slots__`` dataclasses). ``scan`` walks the
object graph instead: modules, optimizers, containers, tensors' own ``__dict__``/slots,
and objects of torch/torchrec/fbgemm classes. For each object it records the slots that
refer to it, so the register stage can swap in a replacement everywhere at once.
"""
from __future__ import annotations

import dataclasses
import types
from collections import defaultdict
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

__all__ = ["Slot", "Graph", "scan", "is_wrapper_tensor"]

_WALK_MODULE_PREFIXES = ("torch", "torchrec", "fbgemm_gpu", "metamat")
_LEAF_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.device, torch.dtype,
               torch.Size, types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
               types.MethodType, type, range, slice)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One reference to an object: ``holder`` refers to it through ``kind``/``key``.

    kind: "attr" (``holder.__dict__[key]``), "slot" (``__slots__`` attribute), "item"
    (``holder[key]`` of a dict or list), "dictkey" (a key of dict ``holder``), "tuple"
    (element ``key`` of a tuple: immutable, cannot be swapped).
    """

    holder: Any
    kind: str
    key: Any

    def set(self, new: Any) -> None:
        """Make this slot refer to ``new``."""
        if self.kind == "attr":
            self.holder.__dict__[self.key] = new
        elif self.kind == "slot":
            object.__setattr__(self.holder, self.key, new)
        elif self.kind == "item":
            self.holder[self.key] = new
        elif self.kind == "dictkey":
            d = self.holder
            items = list(d.items())
            d.clear()
            for k, v in items:
                d[new if k is self.key else k] = v
        else:
            raise TypeError(f"cannot replace an element of an immutable {type(self.holder).__name__}")


# TorchRec's EmbeddingShardingInfo keeps the *unsharded* construction-time parameter
# (`.param`, full table size). It is not model state: eager TorchRec leaves it on meta too.
# Materializing it would cost every rank a full copy of every table.
_UNWALKED_TYPES = frozenset({"EmbeddingShardingInfo"})


def is_wrapper_tensor(t: torch.Tensor) -> bool:
    """ShardedTensor/DTensor: a tensor object without storage of its own."""
    return hasattr(t, "_local_shards") or hasattr(t, "_local_tensor")


def _slot_names(obj: Any) -> Iterator[str]:
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                yield name


def _walkable_object(obj: Any) -> bool:
    if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        return True
    mod = type(obj).__module__ or ""
    return mod.split(".")[0] in _WALK_MODULE_PREFIXES or dataclasses.is_dataclass(obj)


def _children(obj: Any) -> Iterator[Tuple[str, Any, Any]]:
    """Yield (kind, key, child) for every reference held by ``obj``."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            if isinstance(k, torch.Tensor):
                yield "dictkey", k, k
            yield "item", k, v
        return
    if isinstance(obj, list):
        for i, v in enumerate(list(obj)):
            yield "item", i, v
        return
    if isinstance(obj, tuple):
        for i, v in enumerate(obj):
            yield "tuple", i, v
        return
    if isinstance(obj, (set, frozenset)):
        for v in obj:
            yield "tuple", None, v
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for k, v in list(d.items()):
            yield "attr", k, v
    for name in _slot_names(obj):
        try:
            v = object.__getattribute__(obj, name)
        except AttributeError:
            continue
        yield "slot", name, v


class Graph:
    """Result of ``scan``: objects by id, their slots, and a readable path to each."""

    def __init__(self) -> None:
        self.objects: Dict[int, Any] = {}
        self.slots: Dict[int, List[Slot]] = defaultdict(list)
        self.paths: Dict[int, str] = {}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every storage-backed tensor reached (wrapper tensors excluded)."""
        for obj in self.objects.values():
            if isinstance(obj, torch.Tensor) and not is_wrapper_tensor(obj):
                yield obj

    def meta_tensors(self) -> List[torch.Tensor]:
        """Every storage-backed meta tensor reached."""
        return [t for t in self.tensors() if t.device.type == "meta"]

    def of_type(self, cls: type) -> List[Any]:
        return [o for o in self.objects.values() if isinstance(o, cls)]

    def path(self, obj: Any) -> str:
        return self.paths.get(id(obj), "?")


def scan(root: Any, *extra_roots: Any) -> Graph:
    """Walk the object graph from ``root`` and record every tensor, module and slot.

    Args:
        root: usually the model (a DMP or any ``nn.Module``).
        *extra_roots: more objects to walk (e.g. an optimizer).

    Returns:
        A ``Graph``.
    """
    g = Graph()
    stack: List[Tuple[Any, str]] = [(r, "" if i == 0 else f"<root{i}>")
                                    for i, r in enumerate((root,) + extra_roots)]
    for r, p in stack:
        g.objects[id(r)] = r
        g.paths[id(r)] = p or "<model>"
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, torch.Tensor) and not is_wrapper_tensor(obj) and type(obj) is torch.Tensor:
            continue  # plain tensors hold nothing else worth walking
        for kind, key, child in _children(obj):
            if isinstance(child, _LEAF_TYPES) or type(child).__name__ in _UNWALKED_TYPES:
                continue
            if isinstance(child, torch.Tensor) or isinstance(child, (dict, list, tuple, set, frozenset)) \
                    or _walkable_object(child):
                g.slots[id(child)].append(Slot(obj, kind, key))
                if id(child) not in g.objects:
                    g.objects[id(child)] = child
                    name = key if isinstance(key, (str, int)) else type(key).__name__
                    if kind in ("item", "tuple") and isinstance(key, int):
                        cpath = f"{path}[{key}]"
                    else:
                        cpath = f"{path}.{name}" if path else str(name)
                    g.paths[id(child)] = cpath
                    stack.append((child, cpath))
    return g
