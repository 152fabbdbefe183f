"""The object-graph walk in C (graph.scan, csrc/python/graph_walk.h) equals its Python
specification (graph.scan_reference): same objects, slots in the same order (an object's
first slot is where it was first reached), same paths, same tensors in the same order."""
from __future__ import annotations

import collections
import dataclasses
import os
import sys

import pytest
import torch
from torch import nn

from metamat.models.torchrec.graph import Slot, scan, scan_reference



def _summary(g):
    def key(k):
        return ("tensor", id(k)) if isinstance(k, torch.Tensor) else k

    slots = {i: [(id(s.holder), s.kind, key(s.key)) for s in v] for i, v in g.slots.items() if v}
    return (list(g.objects), slots, [id(t) for t in g._tensors], g.paths,
            g._root_names, [(id(h), k) for h, k in g.device_refs])


def _same(*roots):
    want, got = scan_reference(*roots), scan(*roots)
    assert _summary(got) == _summary(want)
    return got


@dataclasses.dataclass(slots=True)  # walked: a dataclass; its fields are __slots__
class WithSlots:
    a: object
    b: object
    unset: object = dataclasses.field(default=None)


@dataclasses.dataclass
class Config:
    w: torch.Tensor
    name: str = "x"


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2, device="meta")
        self.buf = torch.empty(4, device="meta")
        self.register_buffer("b", torch.zeros(2, device="meta"))
        shared = torch.empty(5, device="meta")
        self.views = [shared, shared[1:], (shared, 3, "s"), {shared: "as key", "k": shared}]
        self.cfg = Config(shared)
        self.slotted = WithSlots(shared, [self.lin.weight])
        del self.slotted.unset  # an empty slot is skipped
        self.sets = {frozenset({1, 2}), ("t", self.buf)}
        od = collections.OrderedDict(a=self.buf, b=shared, c=[self])  # a cycle back
        od.move_to_end("a")  # the OrderedDict's order differs from its dict storage's
        self.od = od
        self.dd = collections.defaultdict(list, x=[shared])
        self.p = nn.Parameter(torch.empty(2, device="meta"))
        self.p.extra = torch.empty(1, device="meta")  # a tensor's own __dict__
        self.cfg.device, self.where = torch.device("meta"), "meta"  # device attributes


def test_c_walk_equals_python_on_every_container_kind():
    m = Holder()
    g = _same(m)
    assert sum(1 for t in g.tensors() if t.device.type == "meta") >= 7
    assert any(s.kind == "dictkey" for v in g.slots.values() for s in v)
    assert any(s.kind == "slot" for v in g.slots.values() for s in v)
    assert {k for h, k in g.device_refs if h is m.cfg or h is m} >= {"device", "where"}


def test_extra_roots_tensor_roots_and_roots_reached_again():
    m = Holder()
    opt_like = {"state": {m.p: {"m": torch.empty(2, device="meta")}}, "model": m}
    _same(m, opt_like)
    _same(m.buf, m)  # a tensor as the first root
    g = _same(m, m.od)  # a root that the first root also reaches
    assert id(m.od) in g.slots and g.slots[id(m.od)]


def test_slot_set_swaps_every_kind():
    m = Holder()
    g = scan(m)
    old = m.cfg.w
    new = torch.zeros(5)
    for s in g.slots[id(old)]:
        if s.kind != "tuple":
            s.set(new)
    assert m.cfg.w is new and m.slotted.a is new and m.views[0] is new
    assert m.views[2][0] is old  # a tuple element cannot be swapped
    assert any(k is new for k in m.views[3]) and m.views[3]["k"] is new
    assert isinstance(Slot(1, "attr", "x"), tuple) and Slot(1, "attr", "x").key == "x"


def test_errors_in_the_walk_propagate():
    class Bad:
        @property
        def __dict__(self):
            raise RuntimeError("no dict for you")

    Bad.__module__ = "metamat.fake"  # walked like metamat's own objects

    # Python's getattr(obj, "__dict__", None) lets RuntimeError through too
    for walk in (scan_reference, scan):
        with pytest.raises(RuntimeError, match="no dict"):
            walk(nn.ModuleList(), [Bad()])


def test_c_walk_equals_python_on_a_sharded_model(world1_env):
    import metamat

    from metamat.models.torchrec import testing as bs

    sharder, plan = bs.sharder_and_plan(bs.ebc(20))
    dmp = metamat.shard_on_meta(bs.ebc(20), env=world1_env, plan=plan, sharders=[sharder])
    g = _same(dmp, dmp.fused_optimizer)
    assert len(g.meta_tensors()) >= 20


def test_c_walk_equals_python_on_several_sharded_modules(world1_env):
    import metamat
    from torchrec.distributed.types import ShardedModule, ShardingPlan

    from metamat.models.torchrec import testing as bs

    proto, plans = bs.towers(3, tables=2), {}
    for j in range(3):
        sharder, tower_plan = bs.sharder_and_plan(proto.towers[f"m{j}"])
        plans[f"towers.m{j}"] = tower_plan.plan[""]
    dmp = metamat.shard_on_meta(bs.towers(3, tables=2), env=world1_env,
                                plan=ShardingPlan(plans), sharders=[sharder])
    g = _same(dmp, dmp.fused_optimizer)
    modules = [o for o in g.objects.values() if isinstance(o, ShardedModule)]
    assert modules == [dmp.module.towers[f"m{j}"] for j in range(3)]  # in the order reached


@dataclasses.dataclass(eq=False)  # walked: a dataclass
class _Unit:
    items: list


@dataclasses.dataclass(eq=False)
class _Other:
    items: list


def test_objects_of_later_types_are_walked_one_at_a_time(monkeypatch):
    """Breadth-first, but an object of a `later` type (TorchRec's sharded modules) waits until
    nothing else is queued; then it and what only it reaches are walked before the next one."""
    from metamat.models.torchrec import graph

    monkeypatch.setattr(graph, "_walked_later", lambda: (_Unit,))
    t = [torch.empty(i + 1, device="meta") for i in range(4)]
    a_deep, b_deep = _Other([t[0]]), _Other([t[1]])
    a, b = _Unit([a_deep]), _Unit([b_deep])
    near = _Other([t[2], _Other([t[3]])])
    root = [a, near, b]
    # recorded when first reached: the root's three, then what `near` reaches, then `a`'s
    # and then `b`'s own (the tensors in the same order)
    want = [root, a, near, b, near.items, near.items[1], near.items[1].items,
            a.items, a_deep, a_deep.items, b.items, b_deep, b_deep.items]
    for walk in (scan_reference, scan):
        g = walk(root)
        order = [o for o in g.objects.values() if not isinstance(o, torch.Tensor)]
        assert [id(o) for o in order] == [id(o) for o in want], walk.__name__
        assert [id(x) for x in g._tensors] == [id(t[2]), id(t[3]), id(t[0]), id(t[1])]
    _same(root)


def test_shard_metadata_is_searched_for_devices_not_recorded():
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                    TensorProperties)

    m = Holder()
    sm = ShardMetadata(shard_offsets=[0, 0], shard_sizes=[5, 2], placement="rank:0/meta")
    m.md = ShardedTensorMetadata(shards_metadata=[sm, sm], size=torch.Size([5, 2]),
                                 tensor_properties=TensorProperties(dtype=torch.float32))
    hidden, unread = torch.empty(3, device="meta"), torch.empty(2, device="meta")
    m.md.extra = [5, hidden]  # a field a newer torch might add: still searched, and a
    # tensor inside metadata is found and swappable
    sm.shard_sizes = [5, unread]  # offsets and sizes hold ints: left unread (one cache miss
    # each at 10k tables)
    g = _same(m)
    assert not g.of_type(ShardMetadata) and not g.of_type(ShardedTensorMetadata)
    assert (sm.placement, "_device") in [(h, k) for h, k in g.device_refs]
    assert sum(1 for h, _ in g.device_refs if h is sm.placement) == 1  # shared: searched once
    (slot,) = g.slots[id(hidden)]
    assert slot.holder is m.md.extra and slot.key == 1
    assert id(unread) not in g.objects


def test_containers_of_leaves_are_not_recorded():
    m = Holder()
    m.names, m.empty, m.mixed = ["a", "b", 3], {}, [1, "x", m.buf]
    m.leaf_dict = {"k": 1.0, 2: None}
    g = _same(m)
    for leafy in (m.names, m.empty, m.leaf_dict):
        assert id(leafy) not in g.objects
    assert id(m.mixed) in g.objects and g.slots[id(m.buf)]


class _HookObject:  # a callable object of a walked kind holding a tensor
    def __init__(self, t):
        self.t = t

    def __call__(self, *args, **kwargs):
        return None


_HookObject.__module__ = "metamat.fake"


def test_hook_registries_are_not_read():
    """Modules' and optimizers' hook registries hold code, not state: the walk skips them by
    name (unread, ~13 per table of a sharded model), also when a hook is an object that would
    be walked elsewhere; an attribute of the same name on another object is walked."""
    m = Holder()
    hidden = torch.empty(3, device="meta")
    m.register_forward_hook(_HookObject(hidden))
    m.lin.register_forward_pre_hook(_HookObject(hidden))
    m.register_load_state_dict_pre_hook(_HookObject(hidden))  # torch wraps it (_WrappedHook)
    opt = torch.optim.SGD([nn.Parameter(torch.empty(2, device="meta"))], lr=0.1)
    opt.register_step_pre_hook(_HookObject(hidden))
    m.opt = opt
    g = _same(m)
    assert id(hidden) not in g.objects
    for registry in (m._forward_hooks, m.lin._forward_pre_hooks,
                     m._load_state_dict_pre_hooks, opt._optimizer_step_pre_hooks):
        assert registry and id(registry) not in g.objects
    assert id(opt.param_groups[0]["params"][0]) in g.objects  # the optimizer's state is walked

    other = _HookObject(None)
    other._forward_hooks = {"h": _HookObject(hidden)}  # not a module: an ordinary attribute
    m.other = other
    g = _same(m)
    assert g.slots[id(hidden)] and g.path(hidden) == "other._forward_hooks.h.t"


def test_shared_constants_and_handles_are_leaves(world1_env):
    """Enum members, layouts, memory formats and process groups hold no tensor: no slots for
    them (a sharded model refers to them ~20 times per table); TensorProperties, whose fields
    are all leaves, is not even searched; a TensorProperties-like dataclass with another field
    set is searched as before."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    from torchrec.modules.embedding_configs import PoolingType

    from metamat.models.torchrec import graph

    m = Holder()
    m.pool, m.layout, m.fmt = PoolingType.SUM, torch.strided, torch.contiguous_format
    m.pg = dist.group.WORLD
    m.props = TensorProperties(dtype=torch.float32)
    g = _same(m)
    for leaf in (m.pool, m.layout, m.fmt, m.pg, m.props):
        assert id(leaf) not in g.objects and not g.slots.get(id(leaf))
    assert graph._kind_of(m.props) == 0

    @dataclasses.dataclass
    class TensorProperties:  # same name and module path, another field set: searched
        dtype: torch.dtype = torch.float32
        device: torch.device = torch.device("meta")

    TensorProperties.__module__ = "torch.distributed._shard.sharded_tensor.metadata"
    TensorProperties.__qualname__ = "TensorProperties"
    newer = TensorProperties()
    m.props = newer
    try:
        g = _same(m)
        assert graph._kind_of(newer) == 3 and (newer, "device") in g.device_refs
    finally:
        graph._KIND.pop(TensorProperties, None)


def test_c_walk_equals_python_past_its_tables_first_sizes():
    """Hundreds of types and thousands of objects, dicts nested in dicts: the C walk's
    per-type caches and its searched set grow (they start at 64 entries) and its dict
    snapshots nest, and it still equals the Python walk."""
    from torch.distributed._shard.metadata import ShardMetadata

    types = [dataclasses.make_dataclass(f"T{i}", [("w", object), ("more", object)])
             for i in range(300)]
    for t in types:
        t.__module__ = "metamat.fake"  # walked like metamat's own objects
    shared = torch.empty(8, device="meta")
    objs = [t(shared[i % 8:], {"k": {"deep": [shared]}, i: types[i - 1](None, None)})
            for i, t in enumerate(types)]
    placements = [ShardMetadata(shard_offsets=[i], shard_sizes=[1], placement="rank:0/meta")
                  for i in range(2000)]
    for i, sm in enumerate(placements[::10]):
        # (in the placement: offsets and sizes are not searched)
        sm.placement = [torch.empty(1, device="meta"), {"again": placements[i]}]
    g = _same(objs, {i: p for i, p in enumerate(placements)})
    assert len(g.meta_tensors()) == 300 + 200 + 1


def test_c_walk_equals_python_past_two_mib_of_record():
    """300k objects: the record's vectors and the maps pass 2 MiB, where the C walk asks for
    huge pages (its own allocator: mmap, madvise, munmap), and each grows again there."""
    Cell = dataclasses.make_dataclass("Cell", [("w", object), ("nxt", object)])
    Cell.__module__ = "metamat.fake"
    shared = torch.empty(4, device="meta")
    cells = [Cell(shared if i % 1000 == 0 else None, None) for i in range(300_000)]
    for a, b in zip(cells, cells[7::7]):
        a.nxt = b  # more than one slot for some objects
    g = _same(cells)
    assert len(g.objects) == 300_002 and len(g.slots[id(shared)]) == 300


def test_the_c_walks_record_reads_like_the_python_walks_dicts():
    """``scan`` keeps what it finds in a ``_C.GraphRecord``; ``objects`` and ``slots`` read it
    as mappings with the Python walk's dict/defaultdict behaviour."""
    m = Holder()
    want, g = scan_reference(m), scan(m)
    assert dict(g.objects.items()) == dict(want.objects.items()) and len(g.objects) == len(want.objects)
    assert list(g.objects) == list(want.objects) and list(g.objects.values())[0] is m
    assert id(m.buf) in g.objects and g.objects[id(m.buf)] is m.buf
    assert "x" not in g.objects and 12345 not in g.objects
    stranger = object()
    with pytest.raises(KeyError) as e:
        g.objects[id(stranger)]
    assert e.value.args == (id(stranger),)
    with_slots = [i for i, v in want.slots.items() if v]
    assert list(g.slots) == with_slots and len(g.slots) == len(with_slots)  # the dict's order
    assert g.slots.get(id(stranger)) is None and g.slots.get(id(stranger), []) == []
    assert g.slots[id(stranger)] == [] == g.slots["x"]  # like a defaultdict, adding no key
    assert id(stranger) not in g.slots and None not in g.slots and 2**70 not in g.slots
    assert g.slots.get(2**70) is None and 2**70 not in g.objects and -1 not in g.objects
    assert g.slots[id(m.buf)] is not g.slots[id(m.buf)]  # a new list per call
    lone = nn.Linear(2, 2, device="meta")
    assert id(lone) in scan(lone).objects and id(lone) not in scan(lone).slots  # a root


def test_the_record_holds_its_references_and_releases_them():
    import gc
    import weakref

    m = Holder()
    t = m.buf
    before = sys.getrefcount(t)
    g = scan(m)
    assert sys.getrefcount(t) > before  # the record holds it (and its holders, keys)
    slots = g.slots[id(t)]
    del g
    gc.collect()
    assert sys.getrefcount(t) == before + sum(1 for s in slots if s.holder is t or s.key is t)
    del slots
    assert sys.getrefcount(t) == before
    ref = weakref.ref(m)
    g = scan(m)
    del m, t, g
    gc.collect()
    assert ref() is None  # nothing of the model outlives its graph


def test_tuple_held_equals_the_python_walks():
    m = Holder()
    want, g = scan_reference(m), scan(m)
    assert g.tuple_held() == want.tuple_held()
    assert id(m.views[2][0]) in g.tuple_held() and id(m.buf) in g.tuple_held()  # tuple, set
    assert id(m.lin.weight) not in g.tuple_held()


def test_a_sharded_models_meta_tensor_in_a_nested_tuple_is_refused_before_allocation(
        world1_env):
    """A tuple inside a tuple cannot be rebuilt where it is held: refused, nothing changed."""
    import metamat
    from metamat.errors import UnsupportedError

    from metamat.models.torchrec import testing as bs

    sharder, plan = bs.sharder_and_plan(bs.ebc(3))
    dmp = metamat.shard_on_meta(bs.ebc(3), env=world1_env, plan=plan, sharders=[sharder])
    weights = [t for t in scan(dmp).meta_tensors() if t.dim() == 1 and t.is_floating_point()]
    dmp.frozen = ((weights[0],),)
    with pytest.raises(UnsupportedError, match=r"frozen\[0\]\[0\] is held in an immutable "
                                               r"container"):
        metamat.materialize(dmp, device="cpu")
    assert weights[0].is_meta and dmp.frozen[0][0] is weights[0]


def test_a_sharded_models_meta_tensor_in_a_plain_tuple_is_swapped(world1_env):
    """TorchRec's ``(tbe, index tensor)`` pairs: a new tuple goes where the old one was held,
    in every holder, its other items kept."""
    import metamat

    from metamat.models.torchrec import testing as bs

    sharder, plan = bs.sharder_and_plan(bs.ebc(3))
    dmp = metamat.shard_on_meta(bs.ebc(3), env=world1_env, plan=plan, sharders=[sharder])
    weights = [t for t in scan(dmp).meta_tensors() if t.dim() == 1 and t.is_floating_point()]
    home = scan(dmp).slots[id(weights[0])][0]  # where the model itself holds it
    pair = (weights[0], "kept", weights[0])
    dmp.pairs = {"a": pair}
    dmp.again = [pair]
    metamat.materialize(dmp, device="cpu")
    new = dmp.pairs["a"]
    assert type(new) is tuple and new[1] == "kept" and dmp.again[0] is new
    assert not new[0].is_meta and new[0] is new[2]
    holder, kind, key = home
    assert (holder.__dict__[key] if kind == "attr" else holder[key]) is new[0]


def test_a_materialized_model_is_freed(world1_env):
    """The C walk's record holds strong references the collector cannot see: no graph may stay
    reachable from the model after materialize (a cycle through it would never be freed)."""
    import gc
    import weakref

    import metamat

    from metamat.models.torchrec import testing as bs

    sharder, plan = bs.sharder_and_plan(bs.ebc(3))
    dmp = metamat.shard_on_meta(bs.ebc(3), env=world1_env, plan=plan, sharders=[sharder])
    metamat.materialize(dmp, device="cpu")
    ref = weakref.ref(dmp)
    del dmp
    gc.collect()
    assert ref() is None


def test_hostile_objects_neither_crash_the_walk_nor_part_it_from_its_specification():
    """tests/hostile_objects.py in a child with PYTHONMALLOC=malloc (a read of freed memory
    crashes there at once): a dict key whose ``__class__`` property or whose type's metaclass
    (asked by ``_kind_of``) empties its dict made the C walk read the freed value (rc -11), a
    dict subclass whose ``items()`` gives no pairs made it read a tuple that was none; an
    object whose ``__class__`` says dict or torch.Tensor was one to the walks. Now the C walk
    holds what it reads and both walks go by types."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, os.path.join(here, "hostile_objects.py")],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONMALLOC="malloc"))
    assert r.returncode == 0, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert " 0 failures" in r.stdout and "key_type_empties_leaf_dict" in r.stdout


def test_an_object_claiming_to_be_a_tensor_is_not_one():
    """``__class__`` returning torch.Tensor fooled isinstance: the walk listed the object as a
    tensor and materialize failed with a raw AttributeError ('is_meta'). Types decide."""
    import metamat

    from hostile_objects import ClaimsTensor

    m = nn.Module()
    m.lin = nn.Linear(3, 2, device="meta")
    m.fake = [ClaimsTensor(), {"k": ClaimsTensor()}]
    for walk in (scan, scan_reference):
        g = walk(m)
        assert all(type(t) is not ClaimsTensor for t in g._tensors)
        assert len(g.meta_tensors()) == 2
    metamat.materialize(m, seed=0, device="cpu")
    assert not m.lin.weight.is_meta and type(m.fake[0]) is ClaimsTensor


def test_fuzz_graph_short_run(tmp_path):
    """fuzz/fuzz_graph.py (the walk against its specification on built object graphs with the
    hostile pieces), 2,000 inputs from an empty corpus; the long run is ``make fuzz``."""
    import subprocess

    pytest.importorskip("atheris")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    r = subprocess.run(
        [sys.executable, os.path.join(root, "fuzz", "fuzz_graph.py"), "-runs=2000", "-seed=1",
         "-timeout=20", f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONMALLOC="malloc", METAMAT_FUZZ_TMP=str(tmp_path / "tmp")))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Done 2000 runs" in r.stderr, r.stderr[-2000:]
