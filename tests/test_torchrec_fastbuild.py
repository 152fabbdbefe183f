"""shard_on_meta builds TorchRec's per-table fused optimizers in linear time
(metamat/models/torchrec/fastbuild.py): what it builds must equal TorchRec's own."""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("torchrec")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


def _model_and_plan(optimizer):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    dims = [8, 16, 8, 16, 8]
    cfgs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=10 + i,
                               feature_names=[f"f{i}"]) for i, d in enumerate(dims)]

    def ebc():
        return EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))

    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": optimizer,
                                                          "learning_rate": 0.05})
    # two column shards of t1 and t3 land in the same group on the one rank: a table name
    # appears twice in the group's config
    per_table = {"t0": table_wise(rank=0), "t1": column_wise(ranks=[0, 0]),
                 "t2": row_wise(), "t3": column_wise(ranks=[0, 0]), "t4": table_wise(rank=0)}
    mp = construct_module_sharding_plan(ebc(), per_table, local_size=1, world_size=1,
                                        device_type="cpu", sharder=sharder)
    for ps in mp.values():
        ps.compute_kernel = "fused"
    return ebc, sharder, ShardingPlan({"": mp}), EmbOptimType


def _describe(value):
    if hasattr(value, "local_shards"):
        md = value.metadata()
        return ("st", tuple(md.size), str(md.tensor_properties.dtype),
                tuple((tuple(s.shard_offsets), tuple(s.shard_sizes)) for s in md.shards_metadata),
                tuple((tuple(s.metadata.shard_offsets), tuple(s.tensor.shape), s.tensor.dtype)
                      for s in value.local_shards()))
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype)
    return value


def _per_table(dmp):
    """Table -> (slice shape, its per-table optimizer's state_dict described)."""
    from metamat.models.torchrec.walk import _wrappers, root_of, sharded_modules

    out = {}
    for _, sm in sharded_modules(root_of(dmp)):
        for m in _wrappers(sm):
            for name, w in m._param_per_table.items():
                (opt,) = w._in_backward_optimizers
                sd = opt.state_dict()
                out[name] = (tuple(w.shape), {
                    k: {sk: _describe(sv) for sk, sv in v.items()}
                    for k, v in sd["state"].items()},
                    [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    return out


@pytest.mark.parametrize("opt", ["EXACT_ROWWISE_ADAGRAD", "EXACT_ADAGRAD", "EXACT_SGD"])
def test_per_table_optimizers_equal_torchrecs(world1_env, opt):
    import metamat
    from metamat.models.torchrec import fastbuild
    from torchrec.distributed.model_parallel import DistributedModelParallel

    ebc, sharder, plan, EmbOptimType = _model_and_plan(None)
    sharder._fused_params["optimizer"] = getattr(EmbOptimType, opt)
    eager = DistributedModelParallel(ebc(), env=world1_env, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])
    calls = []
    real = fastbuild._own_entries
    fastbuild._own_entries = lambda *a: calls.append(1) or real(*a)
    try:
        meta = metamat.shard_on_meta(ebc(), env=world1_env, plan=plan, sharders=[sharder])
    finally:
        fastbuild._own_entries = real
    assert calls, "the linear path was not taken"
    want, got = _per_table(eager), _per_table(meta)
    assert set(want) == {f"t{i}" for i in range(5)}
    for name in want:
        w_shape, w_state, w_groups = want[name]
        g_shape, g_state, g_groups = got[name]
        assert g_shape == w_shape and g_groups == w_groups, name
        # eager tensors are real, metamat's on meta: compare everything but the device
        assert g_state == w_state, name
    # and the whole model's optimizer state is TorchRec's too
    metamat.materialize(meta, device="cpu")
    a, b = eager.fused_optimizer.state_dict()["state"], meta.fused_optimizer.state_dict()["state"]
    assert {k: {sk: _describe(sv) for sk, sv in v.items()} for k, v in a.items()} == \
        {k: {sk: _describe(sv) for sk, sv in v.items()} for k, v in b.items()}


def test_patch_is_undone_and_unknown_signatures_left_alone(world1_env, monkeypatch):
    import dataclasses

    import torchrec.distributed.batched_embedding_kernel as bek
    from metamat.models.torchrec import fastbuild

    init = bek.EmbeddingFusedOptimizer.__init__
    with pytest.raises(RuntimeError):
        with fastbuild.linear_table_optimizers():
            assert bek.EmbeddingFusedOptimizer.__init__ is not init
            raise RuntimeError("boom")
    assert bek.EmbeddingFusedOptimizer.__init__ is init and bek.dataclass is dataclasses.dataclass
    monkeypatch.setattr(fastbuild, "_CHECKED_SIGNATURE", ["self", "something", "else"])
    with fastbuild.linear_table_optimizers():
        assert bek.EmbeddingFusedOptimizer.__init__ is init
