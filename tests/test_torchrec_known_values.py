"""TBE metadata values: what shard_on_meta records while fbgemm builds a TBE equals what
fbgemm's constructor gives when re-run (tbe.rebuild_tbe_metadata), so the plan skips that
re-run for such models; a DMP built directly on meta records nothing and is rebuilt."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")


def _model(kernel: str):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfgs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=10 + i,
                               feature_names=[f"f{i}"]) for i, d in enumerate([8, 16, 8, 16])]

    def ebc():
        return EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))

    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    per_table = {"t0": table_wise(rank=0), "t1": column_wise(ranks=[0, 0]), "t2": row_wise(),
                 "t3": table_wise(rank=0)}
    mp = construct_module_sharding_plan(ebc(), per_table, local_size=1, world_size=1,
                                        device_type="cpu", sharder=sharder)
    for ps in mp.values():
        ps.compute_kernel = kernel
    return ebc, sharder, ShardingPlan({"": mp})


def _wrappers(model):
    from metamat.models.torchrec.sharded import root_of, sharded_modules, wrappers

    return [w for _, sm in sharded_modules(root_of(model)) for w in wrappers(sm)]


def _eager(env, ebc, sharder, plan):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return DistributedModelParallel(ebc(), env=env, device=torch.device("cpu"), plan=plan,
                                    sharders=[sharder])


def _integer_metadata_equals_eager(model, eager) -> int:
    """Every non-empty integer tensor of each TBE equals eager DMP's; returns how many."""
    from metamat.models.torchrec.values import own_tensors as _own_tensors

    n = 0
    for got, want in zip(_wrappers(model), _wrappers(eager), strict=True):
        g, e = _own_tensors(got._emb_module), _own_tensors(want._emb_module)
        assert set(g) == set(e)
        for name, t in g.items():
            if t.is_floating_point() or t.numel() == 0:
                continue
            assert t.device.type == "cpu" and torch.equal(t, e[name]), name
            n += 1
    return n


def _materialize_counting_rebuilds(model, monkeypatch) -> int:
    """materialize(model) on the CPU; how many TBEs it rebuilt through fbgemm's constructor."""
    import metamat
    from metamat.models.torchrec import tbe

    real = tbe.rebuild_tbe_metadata
    calls = []
    monkeypatch.setattr(tbe, "rebuild_tbe_metadata", lambda *a: calls.append(a) or real(*a))
    metamat.materialize(model, device="cpu")
    return len(calls)


@pytest.mark.parametrize("kernel", ["fused", "dense"])
def test_recorded_tbe_values_equal_fbgemms_rebuild(world1_env, kernel, monkeypatch):
    import metamat
    from metamat.models.torchrec import tbe
    from metamat.models.torchrec.values import own_tensors as _own_tensors, value_unknown as _value_unknown

    ebc, sharder, plan = _model(kernel)
    dmp = metamat.shard_on_meta(ebc(), env=world1_env, plan=plan, sharders=[sharder])
    checked = 0
    for w in _wrappers(dmp):
        own = _own_tensors(w._emb_module)
        assert not [n for n, t in own.items() if _value_unknown(t)]
        rebuilt = tbe.rebuild_tbe_metadata(w, torch.device("cpu"))
        # floating metadata the rebuild would make real would be zeroed without it
        assert not [n for n, t in rebuilt.items() if t.is_floating_point()]
        for name, new in rebuilt.items():
            if own[name].numel() == 0:
                continue
            got = own[name]._metamat_value
            assert got.dtype == new.dtype and torch.equal(got, new), name
            checked += 1
    # the fused TBE's offsets, placements, hash sizes and counters (the dense TBE keeps its
    # integer metadata on the CPU: nothing to record or rebuild)
    assert checked >= 10 if kernel == "fused" else checked == 0
    # every value was recorded: fbgemm's constructor is not run again
    assert _materialize_counting_rebuilds(dmp, monkeypatch) == 0
    for w in _wrappers(dmp):
        own = _own_tensors(w._emb_module)
        assert all(t.device.type == "cpu" for t in own.values())
    n = _integer_metadata_equals_eager(dmp, _eager(world1_env, ebc, sharder, plan))
    assert n >= 10 if kernel == "fused" else n >= 1


def test_a_record_written_since_is_not_trusted(world1_env, monkeypatch):
    """A recorded tensor written in place after its factory call (on meta the write does
    nothing) falls back to fbgemm's rebuild."""
    import metamat
    from metamat.models.torchrec.values import own_tensors as _own_tensors, value_unknown as _value_unknown

    ebc, sharder, plan = _model("fused")
    dmp = metamat.shard_on_meta(ebc(), env=world1_env, plan=plan, sharders=[sharder])
    w = _wrappers(dmp)[0]
    offsets = _own_tensors(w._emb_module)["D_offsets"]
    offsets.mul_(2)  # a no-op on meta that the record cannot know about
    assert _value_unknown(offsets)
    assert _materialize_counting_rebuilds(dmp, monkeypatch)
    assert _integer_metadata_equals_eager(dmp, _eager(world1_env, ebc, sharder, plan)) >= 10


def test_a_dmp_built_on_meta_is_rebuilt(world1_env, monkeypatch):
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from metamat.models.torchrec.values import own_tensors as _own_tensors, value_unknown as _value_unknown

    ebc, sharder, plan = _model("fused")
    dmp = DistributedModelParallel(ebc(), env=world1_env, device=torch.device("meta"), plan=plan,
                                   sharders=[sharder])
    unknown = [n for w in _wrappers(dmp) for n, t in _own_tensors(w._emb_module).items()
               if _value_unknown(t)]
    assert "weights_offsets" in unknown and "D_offsets" in unknown
    assert _materialize_counting_rebuilds(dmp, monkeypatch)
    assert _integer_metadata_equals_eager(dmp, _eager(world1_env, ebc, sharder, plan)) >= 10


def test_torchrec_values_recomputed_only_when_not_recorded(world1_env):
    """The sharded module's own metadata (``_dim_per_key``, the output permutation): what
    shard_on_meta records equals what the plan recomputes for a DMP built on meta, so for the
    former the recomputation (~2 µs per table) is skipped."""
    from torchrec.distributed.model_parallel import DistributedModelParallel

    import metamat
    from metamat.models.torchrec.meta_factories import recorded_value
    from metamat.models.torchrec.values import torchrec_known_values
    from metamat.models.torchrec.sharded import root_of, sharded_modules

    ebc, sharder, plan = _model("fused")

    def sm_of(model):
        (_, sm), = sharded_modules(root_of(model))
        return sm

    recorded = sm_of(metamat.shard_on_meta(ebc(), env=world1_env, plan=plan, sharders=[sharder]))
    assert list(torchrec_known_values(recorded)) == []
    built = sm_of(DistributedModelParallel(ebc(), env=world1_env, device=torch.device("meta"),
                                           plan=plan, sharders=[sharder]))
    computed = {id(old): new for old, new in torchrec_known_values(built)}
    names = ["_dim_per_key"] + [f"_permute_op.{n}" for n in ("_offset_dim_list", "_permute",
                                                             "_inv_permute",
                                                             "_inv_offset_dim_list")]
    compared = 0
    for name in names:
        obj_b, obj_r = built, recorded
        for part in name.split("."):
            obj_b, obj_r = getattr(obj_b, part, None), getattr(obj_r, part, None)
        if obj_b is None or id(obj_b) not in computed:
            continue
        assert obj_r.is_meta and recorded_value(obj_r) is not None, name
        assert torch.equal(computed[id(obj_b)], recorded_value(obj_r)), name
        compared += 1
    assert compared >= 3, compared


def test_integer_metadata_nobody_can_compute_is_named(world1_env):
    """An integer meta tensor whose value neither the record nor fbgemm's rebuild can give:
    the plan refuses it before allocating and names where it is held (the path is found only
    for that message)."""
    import metamat

    ebc, sharder, plan = _model("fused")
    dmp = metamat.shard_on_meta(ebc(), env=world1_env, plan=plan, sharders=[sharder])
    w = _wrappers(dmp)[0]
    w._emb_module.mystery_ids = torch.empty(7, dtype=torch.int64, device="meta")
    with pytest.raises(metamat.UnsupportedError, match=r"mystery_ids.*int64, shape \(7,\)"):
        metamat.materialize(dmp, device="cpu")
    assert w._emb_module.mystery_ids.is_meta  # nothing was swapped
