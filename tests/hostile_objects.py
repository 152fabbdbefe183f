"""Hostile objects for the object-graph walk (metamat/models/torchrec/graph.py, its C walk in
csrc/python/graph_walk.h): objects that run code while the walk reads them, the way a model's
own classes can. Each case builds a fresh model (the code it runs changes the model) and the
contract is: no crash, and the C walk gives what its Python specification gives (the same
graph, or the same exception).

Run as a script (``python tests/hostile_objects.py``; ``PYTHONMALLOC=malloc`` makes a read of
freed memory crash at once instead of by chance) it checks every case and prints a summary;
``tests/test_graph_scan.py`` runs it in a child, ``fuzz/fuzz_graph.py`` mixes the pieces.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn


def meddling_type(name: str, action: Callable[[], object]) -> type:
    """A fresh class whose metaclass runs ``action()`` whenever it is asked for an attribute it
    lacks. ``_kind_of`` asks each new type whether it is a dataclass (``__dataclass_fields__``):
    code that runs in the middle of the walk, from a type check (a metaclass ``__getattr__``,
    as ORMs and proxies have). A fresh class per model: each walk meets it as new."""

    class Meta(type):
        def __getattr__(cls, attr):
            if not attr.startswith("__") or attr == "__dataclass_fields__":
                action()
            raise AttributeError(attr)

    return Meta(name, (), {"__hash__": lambda self: 1, "__eq__": lambda a, b: a is b})


class EmptiesItsDict:
    """A dict key whose ``__class__`` (read by ``isinstance``, as ``_kind_of`` did) empties the
    dict it is a key of, freeing the value the walk was about to read."""

    def __init__(self, d: dict) -> None:
        self.d = d

    def __hash__(self) -> int:
        return 1

    @property
    def __class__(self):  # noqa: D401 - the attack
        self.d.clear()
        return EmptiesItsDict


class DeletesAttrs:
    """An attribute value whose ``__class__`` deletes the other attributes of its holder."""

    def __init__(self, holder: Any) -> None:
        self.holder = holder

    @property
    def __class__(self):
        self.holder.__dict__.clear()
        return DeletesAttrs


class ClaimsTensor:
    """An object whose ``__class__`` says ``torch.Tensor``: isinstance believes it, but it has
    no ``is_meta`` (nor anything else of a tensor)."""

    @property
    def __class__(self):
        return torch.Tensor


class ClaimsDict:
    @property
    def __class__(self):
        return dict


class JunkItems(dict):
    """A dict whose ``items()`` gives no (key, value) pairs."""

    def items(self):
        return [1, 2, 3]


class ShortItems(dict):
    def items(self):
        return [("a",)]


class ClearingList(list):
    """A list whose iteration empties it (and frees its items) first."""

    def __iter__(self):
        items = self[:]
        self.clear()
        return iter(items)


class SlotProperty:
    """A walked object (metamat's module prefix) whose slot is shadowed by a property that
    empties a dict the walk is reading."""

    __slots__ = ("a",)


SlotProperty.__module__ = "metamat.fake"


def _meta(n: int = 3) -> torch.Tensor:
    return torch.empty(n, device="meta")


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2, device="meta")


def case_key_class_empties_leaf_dict():
    m = _Base()
    d: dict = {}
    d[EmptiesItsDict(d)] = bytes(range(50)) * 3  # a dict of leaves: "holds nothing" check
    m.d = d
    return m


def case_key_type_empties_leaf_dict():
    m = _Base()
    d: dict = {}
    d[meddling_type("Key", d.clear)()] = bytes(range(50)) * 3  # freed while the walk reads
    m.d = d
    return m


def case_key_type_empties_walked_dict():
    m = _Base()
    d: dict = {}
    d[meddling_type("Key", d.clear)()] = bytes(range(50)) * 3
    d["t"] = _meta()  # not leaves only: the walk reads every item
    d["u"] = [_meta(), b"x" * 100]
    m.d = d
    return m


def case_value_type_empties_list():
    m = _Base()
    items: list = []
    items += [meddling_type("V", items.clear)(), bytes(range(90)), _meta(), [_meta()]]
    m.l = items
    return m


def case_value_deletes_attrs():
    m = _Base()
    holder = type("Cfg", (), {"__module__": "metamat.fake"})()
    holder.first = meddling_type("V", holder.__dict__.clear)()
    holder.w = _meta()
    holder.blob = bytes(range(60)) * 2
    m.cfg = holder
    return m


def case_value_class_deletes_attrs():
    m = _Base()
    holder = type("Cfg", (), {"__module__": "metamat.fake"})()
    holder.first = DeletesAttrs(holder)
    holder.w = _meta()
    m.cfg = holder
    return m


def case_claims_tensor():
    m = _Base()
    m.fake = [ClaimsTensor(), {"k": ClaimsTensor()}]
    m.real = _meta()
    return m


def case_claims_dict():
    m = _Base()
    m.fake = [ClaimsDict(), (ClaimsDict(), _meta())]
    return m


def case_junk_items():
    m = _Base()
    m.d = JunkItems(a=_meta())
    return m


def case_short_items():
    m = _Base()
    m.d = ShortItems(a=_meta())
    return m


def case_clearing_list():
    m = _Base()
    m.l = ClearingList([_meta(), bytes(range(70)), [_meta()]])
    return m


def case_slot_property():
    m = _Base()
    d: dict = {"w": _meta(), "b": bytes(range(80))}
    o = SlotProperty()
    o.a = _meta()
    m.d, m.o = d, o
    # a subclass whose "a" is a property emptying the dict: read through object.__getattribute__
    Sub = type("Sub", (SlotProperty,), {"__slots__": (), "__module__": "metamat.fake",
                                      "a": property(lambda self: d.clear() or 5)})
    s = Sub()
    m.s = s
    return m


CASES: Dict[str, Callable[[], Any]] = {
    name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def summary(g) -> Tuple:
    """What a walk found, by ids (the objects are the same in both walks)."""
    def key(k):
        return ("tensor", id(k)) if type(k) is torch.Tensor or type(k) is nn.Parameter else k

    slots = {i: [(id(s.holder), s.kind, key(s.key)) for s in v] for i, v in g.slots.items()
             if v}
    return (list(g.objects), slots, [id(t) for t in g._tensors], dict(g.paths),
            [(id(h), k) for h, k in g.device_refs])


def _walk(walk, root) -> Tuple[str, Any]:
    try:
        g = walk(root)
        return "ok", (summary(g), [id(t) for t in g.meta_tensors()])
    except Exception as e:  # noqa: BLE001 - the walks must raise alike
        return "raised", type(e).__name__


def check_case(name: str) -> str:
    """Both walks on a fresh build each; returns what happened (raises AssertionError)."""
    from metamat.models.torchrec.graph import scan, scan_reference
    build = CASES[name]
    # the same objects for both walks where the case survives a walk unchanged, else a
    # fresh build each (then compared by shape: counts, tensor count, outcome)
    got = _walk(scan, build())
    want = _walk(scan_reference, build())
    if got[0] != want[0] or (got[0] == "raised" and got[1] != want[1]):
        raise AssertionError(f"{name}: C walk {got}, Python walk {want}")
    if got[0] == "ok":
        (gs, gm), (ws, wm) = got[1], want[1]
        shape = lambda s, m: (len(s[0]), sum(len(v) for v in s[1].values()), len(s[2]),  # noqa
                              sorted(s[3].values()), len(m))
        if shape(gs, gm) != shape(ws, wm):
            raise AssertionError(f"{name}: C walk {shape(gs, gm)}, Python {shape(ws, wm)}")
        return f"ok ({len(gs[2])} tensors)"
    return f"raised {got[1]}"


def run_all() -> Dict[str, str]:
    out = {}
    for name in CASES:
        try:
            out[name] = check_case(name)
        except AssertionError as e:
            out[name] = f"FAIL: {e}"
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = run_all()
    for k, r in res.items():
        print(f"{k:30s} {r}", flush=True)
    bad = [k for k, r in res.items() if r.startswith("FAIL")]
    print(f"{len(res)} cases, {len(bad)} failures")
    sys.exit(1 if bad else 0)
