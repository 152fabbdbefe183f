"""The doors to upstream internals (metamat/models/boundary.py, torch_upstream.py,
torchrec/upstream.py): every patch site is declared, applied only through the registry and
undone on every exit path; a missing declared name is an UnsupportedError naming it, raised
before anything is allocated; no adapter reads a private name around the doors."""
from __future__ import annotations

import os
import re

import pytest
import torch

from metamat.models import boundary
from metamat.models import torch_upstream as tu
from metamat.models.boundary import MISSING, Private, active_patches, apply_patch, patch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the registry ---------------------------------------------------------------------------

def _site_value(site: Private):
    owner = boundary.resolve(site.owner)
    if isinstance(owner, type):
        return owner.__dict__.get(site.name, MISSING)
    return getattr(owner, site.name, MISSING)


def _snapshot():
    return {s.qualname: _site_value(s) for s in boundary.patch_sites()
            if not s.optional or _present(s)}


def _present(site: Private) -> bool:
    try:
        return _site_value(site) is not MISSING
    except (ImportError, AttributeError, RuntimeError):
        return False


def _assert_restored(before):
    assert active_patches() == []
    after = _snapshot()
    changed = [k for k in before if after.get(k) is not before[k]]
    assert not changed, f"patch sites not put back: {changed}"


class _Target:
    value = "original"


def test_patch_restores_on_exception_and_deletes_what_it_added(monkeypatch):
    site = Private(f"{__name__}._Target", "value", "class_attr", ("test",), patched=True)
    added = Private(f"{__name__}._Target", "extra", "class_attr", ("test",), patched=True)
    door = boundary.Boundary("test", lambda: "test 0")
    try:
        door.declare(site, added)
        with pytest.raises(KeyError):
            with patch(site, "new"), patch(added, "added"):
                assert _Target.value == "new" and _Target.extra == "added"
                assert {p.site for p in active_patches()} == {site, added}
                raise KeyError("boom")
        assert _Target.value == "original" and "extra" not in _Target.__dict__
        assert active_patches() == []
        # keep_foreign: a replacement made meanwhile by someone else stays
        p = apply_patch(site, "ours", keep_foreign=True)
        _Target.value = "theirs"
        p.undo()
        assert _Target.value == "theirs"
    finally:
        _Target.value = "original"
        boundary._BOUNDARIES.remove(door)


def test_undeclared_patch_is_refused():
    rogue = Private("torch", "zeros", "function", ("test",), patched=True)  # not a door's
    with pytest.raises(ValueError, match="not a declared patch site"):
        apply_patch(rogue, lambda *a: None)
    declared = tu.site("torch", "zeros")
    assert declared.patched and declared in boundary.patch_sites()


def test_every_declaration_present_on_the_pinned_stack():
    """The static check of every group passes here, and this stack is among the versions the
    declarations say they were checked on."""
    pytest.importorskip("torchrec")
    import fbgemm_gpu
    import torchrec

    from metamat.models.torchrec import upstream as tr

    for door in (tu.BOUNDARY, tr.BOUNDARY):
        assert door.problems() == []
    base = lambda v: v.split("+")[0]  # noqa: E731
    assert base(torchrec.__version__) in tr.TORCHREC
    assert base(fbgemm_gpu.__version__) in tr.FBGEMM
    assert base(torch.__version__) in tu.TORCH
    names = [p.qualname for d in (tu.BOUNDARY, tr.BOUNDARY) for p in d.declared]
    assert len(names) == len(set(names))
    for p in tr.DECLARED + tu.DECLARED:
        assert p.checked and all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in p.checked), p


# -- TorchRec: every site patched while sharding, all undone on every exit path ------------

def _ebc_model(n=5):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    data_parallel, row_wise, table_row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingPlan

    cfgs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=20 + i,
                               feature_names=[f"f{i}"]) for i in range(n)]

    def ebc():
        return EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))

    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    kinds = [table_wise(rank=0), row_wise(), column_wise(ranks=[0, 0]),
             table_row_wise(host_index=0), data_parallel()]
    mp = construct_module_sharding_plan(ebc(), {f"t{i}": kinds[i % len(kinds)]
                                                for i in range(n)},
                                        local_size=1, world_size=1, device_type="cpu",
                                        sharder=sharder)
    for ps in mp.values():
        if ps.sharding_type != "data_parallel":
            ps.compute_kernel = "fused"
    return ebc, sharder, ShardingPlan({"": mp})


@pytest.fixture
def applied(monkeypatch):
    """The declared sites patched while the test runs (the registry's own record)."""
    seen = []
    real = boundary.apply_patch

    def spy(site, new, **kw):
        seen.append(site.qualname)
        return real(site, new, **kw)

    monkeypatch.setattr(boundary, "apply_patch", spy)
    from metamat.models.torchrec import upstream as tr

    monkeypatch.setattr(tr, "apply_patch", spy)
    monkeypatch.setattr(tu, "apply_patch", spy)
    return seen


def test_every_patch_site_is_used_and_undone(world1_env, applied):
    """shard_on_meta (CPU and CUDA layouts, 2D parallel, fully sharded) and the materialize of a DMP TorchRec built on
    meta (fbgemm's constructor re-run: tbe.capture_tbe_args) apply every declared patch site
    that exists here, each put back afterwards."""
    import metamat
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingStrategy

    before = _snapshot()
    ebc, sharder, plan = _ebc_model()
    metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder])
    _assert_restored(before)
    fused_only = _ebc_model(3)
    metamat.shard_on_meta(fused_only[0](), world1_env, plan=fused_only[2],
                          sharders=[fused_only[1]], compute_device="cuda")
    _assert_restored(before)
    fused_only = _ebc_model(3)  # TorchRec's 2D parallelism, one group of this one rank
    metamat.shard_on_meta(fused_only[0](), world1_env, plan=fused_only[2],
                          sharders=[fused_only[1]], compute_device="cuda", sharding_group_size=1,
                          sharding_strategy=ShardingStrategy.FULLY_SHARDED)
    _assert_restored(before)
    dmp = DistributedModelParallel(ebc(), env=world1_env, device=torch.device("meta"),
                                   plan=plan, sharders=[sharder])
    metamat.materialize(dmp, device="cpu")
    _assert_restored(before)
    # every existing site was applied by one of them; none other than a declared one can be
    expected = set(before)
    assert expected <= set(applied), sorted(expected - set(applied))
    assert set(applied) <= {s.qualname for s in boundary.patch_sites()}


@pytest.mark.parametrize("layout", ["cpu", "cuda"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_patches_undone_when_torchrec_raises_midway(world1_env, monkeypatch, applied, layout,
                                                    exc):
    """TorchRec's constructor raising in the middle of shard_on_meta (after every patch is in
    force, its first tables built): nothing stays patched."""
    import metamat
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    before = _snapshot()
    real = ShardedEmbeddingBagCollection._create_output_dist

    def boom(self, *a, **kw):
        assert active_patches(), "raised inside the window"
        real(self, *a, **kw)
        raise exc("boom")

    monkeypatch.setattr(ShardedEmbeddingBagCollection, "_create_output_dist", boom)
    ebc, sharder, plan = _ebc_model(3 if layout == "cuda" else 5)
    module = ebc()
    with pytest.raises(exc, match="boom"):
        metamat.shard_on_meta(module, world1_env, plan=plan, sharders=[sharder],
                              compute_device="cuda" if layout == "cuda" else None)
    assert applied  # the failure came after the patches
    _assert_restored(before)


def test_patches_undone_when_the_tbe_rebuild_raises(world1_env, monkeypatch, applied):
    """materialize of a DMP TorchRec built on meta re-runs fbgemm's constructor with the kernel
    module's TBE classes stopped (tbe.capture_tbe_args); a failure there restores them, and the
    model is left on meta."""
    import metamat
    from metamat.models.torchrec import tbe
    from torchrec.distributed.model_parallel import DistributedModelParallel

    before = _snapshot()
    ebc, sharder, plan = _ebc_model(3)
    dmp = DistributedModelParallel(ebc(), env=world1_env, device=torch.device("meta"),
                                   plan=plan, sharders=[sharder])

    def boom(config):
        assert active_patches()
        raise RuntimeError("boom")

    monkeypatch.setattr(tbe, "_config_copy", boom)
    with pytest.raises(RuntimeError, match="boom"):
        metamat.materialize(dmp, device="cpu")
    assert applied
    _assert_restored(before)
    assert all(p.is_meta for p in dmp.module.parameters())


def test_relayout_failure_restores_patches_and_model(world1_env, monkeypatch, applied):
    """A DMP on fbgemm's CPU layout materialized on the (emulated) GPU is sharded again for
    the CUDA layout (relayout: every CUDA patch site); TorchRec raising inside puts the patches
    and the model back."""
    import metamat
    from metamat.emulation import emulated_cuda
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    ebc, sharder, plan = _ebc_model(3)
    dmp = metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder])
    old = dmp.module
    before = _snapshot()
    real = ShardedEmbeddingBagCollection._create_output_dist

    def boom(self, *a, **kw):
        real(self, *a, **kw)
        raise RuntimeError("boom")

    monkeypatch.setattr(ShardedEmbeddingBagCollection, "_create_output_dist", boom)
    with emulated_cuda(), pytest.raises(RuntimeError, match="boom"):
        metamat.materialize(dmp, device="cuda")
    assert any(s.endswith("BatchedFusedEmbeddingBag.__init__") for s in applied)
    _assert_restored(before)
    assert dmp.module is old


# -- a missing declared name: UnsupportedError naming it, before anything is allocated -------

@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if metamat allocates (every allocation goes through Allocation)."""
    from metamat import allocate

    calls = []
    real = allocate.Allocation.__init__

    def spy(self, *a, **kw):
        calls.append(a)
        real(self, *a, **kw)

    monkeypatch.setattr(allocate.Allocation, "__init__", spy)
    return calls


@pytest.fixture
def fresh_checks():
    """The doors check again (a group passed earlier in this process is otherwise trusted)."""
    from metamat.models.torchrec import upstream as tr

    for door in (tu.BOUNDARY, tr.BOUNDARY):
        door.forget()
    yield
    for door in (tu.BOUNDARY, tr.BOUNDARY):
        door.forget()


def test_missing_patch_target_raises_before_anything_is_built(world1_env, monkeypatch,
                                                              fresh_checks):
    import metamat
    import torchrec.distributed.batched_embedding_kernel as bek
    from torchrec.distributed.model_parallel import DistributedModelParallel

    before = _snapshot()
    built = []
    real_init = DistributedModelParallel.__init__
    monkeypatch.setattr(DistributedModelParallel, "__init__",
                        lambda self, *a, **kw: built.append(1) or real_init(self, *a, **kw))
    monkeypatch.delattr(bek, "DenseTableBatchedEmbeddingBagsCodegen")
    ebc, sharder, plan = _ebc_model()
    with pytest.raises(metamat.UnsupportedError) as e:
        metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder])
    msg = str(e.value)
    assert "torchrec.distributed.batched_embedding_kernel.DenseTableBatchedEmbeddingBagsCodegen" \
        in msg and "checked on torchrec 1.6.1" in msg and "nothing was allocated" in msg
    assert not built and active_patches() == []
    monkeypatch.undo()
    _assert_restored(before)


def test_missing_method_of_a_class_raises(world1_env, monkeypatch, fresh_checks):
    import metamat
    from torchrec.distributed.batched_embedding_kernel import EmbeddingFusedOptimizer

    monkeypatch.delattr(EmbeddingFusedOptimizer, "__init__")  # inherited now: not its own
    ebc, sharder, plan = _ebc_model()
    with pytest.raises(metamat.UnsupportedError, match=r"EmbeddingFusedOptimizer\.__init__ "
                       r"\(method; checked on torchrec .*\): not defined by the class itself"):
        metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder])


@pytest.mark.parametrize("attr", ["_lookups", "_output_dists", "_embedding_shardings"])
def test_missing_instance_attribute_raises_before_allocation(world1_env, attr, no_allocation,
                                                             fresh_checks):
    """An attribute TorchRec sets in its constructor, gone from the collection (as a rename
    would leave it): materialize names it before allocating, also for one only the register
    stage reads (``_output_dists``)."""
    import metamat

    ebc, sharder, plan = _ebc_model()
    dmp = metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder])
    sm = dmp.module
    delattr(sm, attr)
    assert not hasattr(sm, attr)
    with pytest.raises(metamat.UnsupportedError,
                       match=rf"ShardedEmbeddingBagCollection\.{attr} \(instance attribute; "
                             r"checked on torchrec 1\.6\.1.*missing on the instance"):
        metamat.materialize(dmp)
    assert not no_allocation
    assert all(p.is_meta for p in dmp.parameters())


def test_missing_fbgemm_attribute_raises_before_allocation(world1_env, no_allocation,
                                                           fresh_checks):
    """fbgemm's prefetch state, read only after a load into a live model: checked at plan."""
    import metamat
    from metamat.emulation import emulated_cuda

    ebc, sharder, plan = _ebc_model(3)
    dmp = metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder],
                                compute_device="cuda")
    from metamat.models.torchrec.sharded import sharded_modules, wrappers

    emb = wrappers(sharded_modules(dmp.module)[0][1])[0]._emb_module
    del emb.lxu_cache_locations_empty
    with emulated_cuda(), pytest.raises(metamat.UnsupportedError,
                                        match=r"SplitTableBatchedEmbeddingBagsCodegen\."
                                              r"lxu_cache_locations_empty \(instance attribute; "
                                              r"checked on fbgemm_gpu 1\.6\.0"):
        metamat.materialize(dmp, device="cuda")
    assert not no_allocation


def test_missing_torch_names_raise(world1_env, monkeypatch, fresh_checks):
    """torch's: a placement-check caller (fastranks patches it) and an FSDP2 method."""
    import metamat
    from torch.distributed._shard.sharding_spec import chunk_sharding_spec
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    monkeypatch.delattr(chunk_sharding_spec, "_parse_and_validate_remote_device")
    ebc, sharder, plan = _ebc_model()
    with pytest.raises(metamat.UnsupportedError,
                       match=r"chunk_sharding_spec\._parse_and_validate_remote_device "
                             r"\(function; checked on torch 2\.11\.0"):
        metamat.shard_on_meta(ebc(), world1_env, plan=plan, sharders=[sharder])
    assert active_patches() == []
    monkeypatch.undo()
    tu.BOUNDARY.forget()
    monkeypatch.delattr(FSDPParam, "reset_sharded_param")
    with pytest.raises(metamat.UnsupportedError, match=r"FSDPParam\.reset_sharded_param"):
        tu.require("fsdp2")


def test_fsdp_param_groups_of_torch_2_11(monkeypatch):
    """torch 2.11 keeps one parameter group in ``_fsdp_param_group``: read too; neither name
    is an UnsupportedError naming both (was: no FSDP parameter found, silently)."""
    import metamat

    class State:
        pass

    old, new, neither = State(), State(), State()
    old._fsdp_param_group = "g"
    new._fsdp_param_groups = ["g1", "g2"]
    assert tu._param_groups(old) == ["g"] and tu._param_groups(new) == ["g1", "g2"]
    none = State()
    none._fsdp_param_group = None
    assert tu._param_groups(none) == []
    with pytest.raises(metamat.UnsupportedError, match="_fsdp_param_groups.*_fsdp_param_group"):
        tu._param_groups(neither)


# -- no private upstream name read around the doors -------------------------------------------

#: ``getattr``/``hasattr`` of an underscore name with a literal, outside the doors; each
#: allowed one says why
_ALLOWED = {
    ("metamat/models/torchrec/graph_kinds.py", "_local_shards"): "type test of any tensor subclass "
    "(ShardedTensor's and DTensor's names are declared in torch_upstream)",
    ("metamat/models/torchrec/graph_kinds.py", "_local_tensor"): "the same type test",
    ("metamat/models/module_values.py", "_init_weights"): "a module's own init method "
    "(transformers' name: the Hugging Face door's, not torch's or TorchRec's)",
}
_DOORS = ("metamat/models/boundary.py", "metamat/models/torch_upstream.py",
          "metamat/models/torchrec/upstream.py", "metamat/models/hf/upstream.py")


def test_no_private_getattr_around_the_doors():
    pat = re.compile(r"\b(?:getattr|hasattr)\(\s*[\w.()\[\]]+\s*,\s*[\"'](_[a-zA-Z]\w*)[\"']")
    found = []
    for base in ("metamat/models",):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, base)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if rel in _DOORS:
                    continue
                with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                    for m in pat.finditer(fh.read()):
                        name = m.group(1)
                        if name.startswith("_metamat") or name.startswith("__") \
                                or (rel, name) in _ALLOWED:
                            continue
                        found.append(f"{rel}: {name}")
    assert not found, found


#: the one patch outside the registry: the Hugging Face init trace's recorders replace the
#: init functions of transformers.initialization and of the torch modules transformers lists
#: (its TORCH_MODULES_TO_PATCH: known only at run time), one trace at a time, restored in a
#: finally (hf/init_trace.py); the Hugging Face door's, not TorchRec's or torch's
_OUTSIDE_REGISTRY = ("metamat/models/hf/init_trace.py",)


def test_no_patch_around_the_registry():
    """Assignments to an upstream module's or class's attribute (``bek.X = ...``,
    ``setattr(mod, ...)``, ``cls.__init__ = ...``) appear only in the registry."""
    pat = re.compile(r"^\s*(?:(?:bek|mod|cls|w|torch|namespace)\.\w+\s*=[^=]|"
                     r"setattr\((?:bek|mod|cls|namespace|torch|target)\b)", re.M)
    found = []
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, "metamat/models")):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
            if not f.endswith(".py") or rel == "metamat/models/boundary.py" \
                    or rel in _OUTSIDE_REGISTRY:
                continue
            with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
                found += [f"{rel}: {m.group(0).strip()}" for m in pat.finditer(fh.read())]
    assert not found, found


def test_check_upstream_script_finds_every_declaration_on_instances():
    """scripts/check_upstream.py (how versions get into the ``checked`` tuples) builds the
    models metamat handles and finds every required declaration present on this stack, each
    instance attribute on an instance of its class."""
    pytest.importorskip("torchrec")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_upstream", os.path.join(ROOT, "scripts", "check_upstream.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    result = mod.run()
    assert result["errors"] == []
    bad = {k: v for k, v in result["declarations"].items()
           if v != "ok" and not v.startswith("optional")}
    assert not bad, bad


def test_a_speed_up_left_alone_is_recorded(monkeypatch):
    """fastbuild leaves TorchRec's constructor alone when its signature is not the one it was
    checked against (TorchRec's own code runs, same result): recorded, not silent."""
    pytest.importorskip("torchrec")
    import torchrec.distributed.batched_embedding_kernel as bek

    from metamat.models.torchrec import fastbuild
    from metamat.models.torchrec import upstream as tr

    monkeypatch.setattr(fastbuild, "_CHECKED_SIGNATURE", ["self", "something", "else"])
    monkeypatch.setattr(tr.BOUNDARY, "left_alone", [])
    init = bek.EmbeddingFusedOptimizer.__dict__["__init__"]
    with fastbuild.linear_table_optimizers():
        assert bek.EmbeddingFusedOptimizer.__dict__["__init__"] is init
    site = tr.site(f"{tr.BEK}.EmbeddingFusedOptimizer", "__init__")
    assert tr.BOUNDARY.left_alone == [(site, "signature differs from the one checked")]
