"""metamat's own calls raise no DeprecationWarning / FutureWarning.

A 2-rank ``shard_on_meta`` + ``materialize`` of a DLRM whose tables are row-wise (FUSED) and
data-parallel (DENSE: TorchRec wraps their lookups in DDP, and the dense part gets DMP's own
DDP) once printed a ``broadcast_buffers is deprecated`` FutureWarning for every DDP built.
"""
from __future__ import annotations

import os
import warnings

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from _dist import run_dist  # noqa: E402

PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "metamat" + os.sep


def _worker(rank, world_size):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan,
                                                    data_parallel, row_wise)
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM

    import metamat

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40,
                                 feature_names=[f"f{i}"]) for i in range(3)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[8, 8],
                 over_arch_layer_sizes=[8, 1], dense_device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    per = {"t0": row_wise(), "t1": row_wise(), "t2": data_parallel()}
    mp = construct_module_sharding_plan(model.sparse_arch.embedding_bag_collection, per,
                                        local_size=world_size, world_size=world_size,
                                        device_type="cpu", sharder=sharder)
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": mp})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dmp = metamat.shard_on_meta(model, plan=plan, sharders=[sharder])
        metamat.materialize(dmp, device="cpu", seed=0)
    return [(w.category.__name__, w.filename, str(w.message)[:200]) for w in seen]


@pytest.mark.multiprocess
def test_materialize_raises_no_deprecation_warning_of_its_own():
    per_rank = run_dist(_worker, 2)
    for seen in per_rank:
        deprecations = [w for w in seen if w[0] in ("DeprecationWarning", "FutureWarning")]
        ours = [w for w in deprecations if w[1].startswith(PKG)]
        assert not ours, ours
        assert not [w for w in deprecations if "broadcast_buffers" in w[2]], deprecations
