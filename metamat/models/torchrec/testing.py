"""TorchRec models of N tables on meta and their sharding plans, for tests and benchmarks
(the project's tests and ``bench/bench_scale.py`` share them). Nothing in metamat uses them.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["ebc", "sharder_and_plan", "towers"]


def ebc(n: int, rows: int = 100, dim: int = 16):
    """An EmbeddingBagCollection of ``n`` tables ``t{i}`` (``rows`` x ``dim``, feature
    ``f{i}``) on meta."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfgs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                               feature_names=[f"f{i}"]) for i in range(n)]
    return EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))


def sharder_and_plan(collection, world_size: int = 1, row_wise: bool = False):
    """The sharder (FUSED, row-wise Adagrad) and plan of an EmbeddingBagCollection: every
    table on rank 0, or with ``row_wise`` every table split over all ``world_size`` ranks (8
    per host)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingPlan

    sharder = EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    mp = sp.construct_module_sharding_plan(
        collection, {c.name: sp.row_wise() if row_wise else sp.table_wise(rank=0)
                     for c in collection.embedding_bag_configs()},
        local_size=min(8, world_size), world_size=world_size, device_type="cpu",
        sharder=sharder)
    for _, ps in mp.items():
        ps.compute_kernel = "fused"
    return sharder, ShardingPlan({"": mp})


def towers(m: int, tables: int = 10) -> nn.Module:
    """``m`` EmbeddingBagCollections ``towers.m{j}`` of ``tables`` tiny tables each, on meta."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.towers = nn.ModuleDict({
                f"m{j}": EmbeddingBagCollection(tables=[
                    EmbeddingBagConfig(name=f"m{j}t{i}", embedding_dim=16, num_embeddings=100,
                                       feature_names=[f"m{j}f{i}"]) for i in range(tables)],
                    device=torch.device("meta")) for j in range(m)})

    return Towers()
