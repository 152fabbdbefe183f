"""shard_on_meta builds TorchRec's per-table fused optimizers in linear time
(metamat/models/torchrec/fastbuild.py): what it builds must equal TorchRec's own."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")


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
    from metamat.models.torchrec.sharded import root_of, sharded_modules, wrappers

    out = {}
    for _, sm in sharded_modules(root_of(dmp)):
        for m in wrappers(sm):
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
    import copy
    import dataclasses

    import torchrec.distributed.batched_embedding_kernel as bek
    from metamat.models.torchrec import fastbuild

    init = bek.EmbeddingFusedOptimizer.__init__
    with pytest.raises(RuntimeError):
        with fastbuild.linear_table_optimizers():
            assert bek.EmbeddingFusedOptimizer.__init__ is not init
            raise RuntimeError("boom")
    assert bek.EmbeddingFusedOptimizer.__init__ is init and bek.dataclass is dataclasses.dataclass
    assert bek.copy is copy
    monkeypatch.setattr(fastbuild, "_CHECKED_SIGNATURE", ["self", "something", "else"])
    with fastbuild.linear_table_optimizers():
        assert bek.EmbeddingFusedOptimizer.__init__ is init


def _metadata(placements):
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                    TensorProperties)
    shards = [ShardMetadata([10 * i, 0], [10, 16], p) for i, p in enumerate(placements)]
    shards[-1].placement = shards[0].placement  # a shared placement stays shared
    return ShardedTensorMetadata(shards, torch.Size([10 * len(shards), 16]),
                                 TensorProperties(torch.bfloat16, requires_grad=True,
                                                  memory_format=torch.channels_last))


def _parts(md):
    """Every mutable object inside a ShardedTensorMetadata, by id."""
    out = [md, md.shards_metadata, md.tensor_properties]
    for s in md.shards_metadata:
        out += [s, s.shard_offsets, s.shard_sizes, s.placement]
    return {id(o) for o in out}


def test_metadata_copy_equals_deepcopy_and_shares_nothing_mutable():
    import copy

    from metamat.models.torchrec import fastbuild

    types = fastbuild._metadata_types()
    assert types is not None  # the fields of this torch version are the checked ones
    md = _metadata(["rank:0/meta", "rank:1/cpu", "rank:2/meta"])
    want = copy.deepcopy(md)
    got = fastbuild._FastDeepcopy(types).deepcopy(md)
    assert got == want and type(got) is type(md)
    assert [vars(s.placement) for s in got.shards_metadata] == \
        [vars(s.placement) for s in want.shards_metadata]
    assert not _parts(got) & _parts(md)
    assert got.shards_metadata[-1].placement is got.shards_metadata[0].placement
    got.shards_metadata[0].shard_sizes[0] = 99  # the copy is independent of the original
    assert md.shards_metadata[0].shard_sizes[0] == 10
    other = [1, {"x": [2]}]
    copied = fastbuild._FastDeepcopy(types).deepcopy(other)  # anything else: copy.deepcopy
    assert copied == other and copied[1] is not other[1]
