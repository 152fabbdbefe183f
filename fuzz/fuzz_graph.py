"""atheris harness: the object-graph walk (graph.scan in C) against its Python specification
(graph.scan_reference) on object graphs built from the input, hostile pieces included.

    PYTHONMALLOC=malloc python fuzz/fuzz_graph.py -runs=2000 CORPUS_DIR

Each input builds a small model twice (one per walk; the pieces change the model while it is
walked): meta tensors, leaves, dicts (keys of strings, tensors or objects), lists, tuples,
frozensets, OrderedDicts, walked objects with ``__dict__`` or ``__slots__``, shared references
and cycles, and tests/hostile_objects.py's pieces: types whose metaclass empties a container
or deletes attributes when asked (as ``_kind_of`` asks every new type), ``__class__``
properties (mutating, or claiming torch.Tensor or dict), dict subclasses whose ``items()``
gives no pairs, a list that empties itself when iterated. Contract: no crash; both walks raise
the same exception type or find the same graph (objects, slots, tensors, paths, counted by
path). ``PYTHONMALLOC=malloc`` makes a read of freed memory crash at once.
"""
import collections
import sys

import atheris

import _harness as H  # noqa: F401  (sys.path: the repository and tests/)

with atheris.instrument_imports(include=["metamat"]):
    import metamat.models.torchrec.graph  # noqa: F401

import torch  # noqa: E402
from torch import nn  # noqa: E402

import hostile_objects as HO  # noqa: E402

_KINDS = 16


def build(data: bytes) -> nn.Module:
    """The model ``data`` describes (the same bytes build the same shape every time)."""
    fdp = atheris.FuzzedDataProvider(data)
    root = nn.Module()
    root.lin = nn.Linear(2, 2, device="meta")
    objs = [root, root.lin.weight]
    holders = [root]  # where new objects are attached: modules, dicts, lists, objects
    Obj = type("Obj", (), {"__module__": "metamat.fake"})  # walked: metamat's prefix
    Slotted = type("Slotted", (), {"__module__": "metamat.fake", "__slots__": ("a", "b")})

    def pick(seq):
        return seq[fdp.ConsumeIntInRange(0, len(seq) - 1)]

    def attach(x, i):
        h = pick(holders)
        if isinstance(h, dict):  # our own containers: the type test runs no hostile code
            k = fdp.ConsumeIntInRange(0, 2)
            key = f"k{i}" if k == 0 else (pick(objs) if k == 1 else torch.empty(1, device="meta"))
            try:
                h[key] = x
            except TypeError:  # unhashable key
                h[f"k{i}"] = x
        elif isinstance(h, list):
            h.append(x)
        elif isinstance(h, Slotted):
            object.__setattr__(h, pick(("a", "b")), x)
        else:
            h.__dict__[f"a{i}"] = x

    for i in range(fdp.ConsumeIntInRange(1, 20)):
        kind = fdp.ConsumeIntInRange(0, _KINDS - 1)
        target = pick(holders)
        if kind == 0:
            x = torch.empty(fdp.ConsumeIntInRange(0, 4), device="meta")
        elif kind == 1:
            x = bytes(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64)))
        elif kind == 2:
            x = {}
            holders.append(x)
        elif kind == 3:
            x = []
            holders.append(x)
        elif kind == 4:
            x = tuple(pick(objs) for _ in range(fdp.ConsumeIntInRange(0, 3)))
        elif kind == 5:
            x = frozenset(range(fdp.ConsumeIntInRange(0, 3)))
        elif kind == 6:
            x = Obj()
            holders.append(x)
        elif kind == 7:
            x = Slotted()
            holders.append(x)
        elif kind == 8:
            x = pick(objs)  # shared references, cycles
        elif kind == 9:  # a type that empties / deletes from a container when asked
            x = HO.meddling_type(f"M{i}", _emptier(target))()
        elif kind == 10:
            x = HO.ClaimsTensor()
        elif kind == 11:
            x = HO.ClaimsDict()
        elif kind == 12:
            x = HO.JunkItems(a=torch.empty(1, device="meta")) if fdp.ConsumeBool() \
                else HO.ShortItems(a=1)
        elif kind == 13:
            x = HO.ClearingList([torch.empty(2, device="meta"), bytes(40)])
        elif kind == 14:
            x = collections.OrderedDict()
            holders.append(x)
        else:
            x = HO.EmptiesItsDict(target) if isinstance(target, dict) else HO.DeletesAttrs(
                target) if not isinstance(target, (list, Slotted)) else bytes(8)
        objs.append(x)
        attach(x, i)
    return root


def _emptier(victim):
    """A callable that empties ``victim`` (a container, an object's attributes or slots)."""
    if isinstance(victim, (dict, list)):
        return victim.clear
    if hasattr(type(victim), "__slots__") and not hasattr(victim, "__dict__"):
        def unset():
            for name in type(victim).__slots__:
                try:
                    object.__delattr__(victim, name)
                except AttributeError:
                    pass
        return unset
    return victim.__dict__.clear


def _shape(outcome):
    kind, v = outcome
    if kind != "ok":
        return outcome
    s, meta = v
    return (kind, len(s[0]), sum(len(x) for x in s[1].values()), len(s[2]),
            sorted(s[3].values()), len(meta))


def TestOneInput(data: bytes) -> None:
    from metamat.models.torchrec.graph import scan, scan_reference
    got = _shape(HO._walk(scan, build(data)))
    want = _shape(HO._walk(scan_reference, build(data)))
    if got != want:
        raise AssertionError(f"C walk {got} != Python walk {want}")


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    H.run(TestOneInput, sys.argv)
