"""DLRM on meta -> metamat.materialize -> train -> dcp.save -> reload into another plan.

    torchrun --nproc_per_node 2 examples/dlrm_meta.py --ckpt /tmp/dlrm_ckpt   # 2 ranks (gloo)
    python examples/dlrm_meta.py --ckpt /tmp/dlrm_ckpt                        # 1 rank

Nothing of the tables is allocated until materialize, which writes each local shard once
with values that do not depend on the plan; the reload reads only this rank's bytes.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                row_wise, table_wise)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM

import metamat

FEATURES = 4


def build_on_meta(rows: int, dim: int) -> DLRM:
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                 feature_names=[f"f{i}"]) for i in range(FEATURES)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=8, dense_arch_layer_sizes=[32, dim],
                over_arch_layer_sizes=[32, 1], dense_device=torch.device("meta"))


def plan_for(model: DLRM, kind: str, world: int, sharder) -> ShardingPlan:
    ebc = model.sparse_arch.embedding_bag_collection
    gens = {"row_wise": lambda i: row_wise(),
            "table_wise": lambda i: table_wise(rank=i % world),
            "column_wise": lambda i: column_wise(ranks=list(range(world)) if world > 1 else [0, 0])}
    per = {f"t{i}": gens[kind](i) for i in range(FEATURES)}
    mp = construct_module_sharding_plan(ebc, per, local_size=world, world_size=world,
                                        device_type="cpu", sharder=sharder)
    return ShardingPlan({"sparse_arch.embedding_bag_collection": mp})


def batch(rows: int, step: int):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (FEATURES * 16,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(FEATURES)],
                                              values=values, lengths=lengths)
    return torch.randn(16, 8, generator=g), kjt, torch.randint(0, 2, (16,), generator=g).float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt", default="/tmp/metamat_dlrm_ckpt")
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})

    # 1. Build on meta, shard row-wise, materialize: each rank writes its shards once.
    model = build_on_meta(a.rows, a.dim)
    dmp = metamat.shard_on_meta(model, plan=plan_for(model, "row_wise", world, sharder),
                                sharders=[sharder])
    report = metamat.materialize(dmp, device="cpu", seed=0)
    if rank == 0:
        print(report)

    # 2. Train a few steps (tables by the fused optimizer, dense parts by SGD).
    opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "embedding_bag" not in n], lr=0.05)
    for step in range(a.steps):
        dense, kjt, label = batch(a.rows, step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, kjt).squeeze(-1), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")

    # 3. Save with torch.distributed.checkpoint, as TorchRec users do.
    dcp.save(dmp.state_dict(), checkpoint_id=a.ckpt)

    # 4. Reload into a different plan (table-wise): each rank reads only its tables' bytes.
    model2 = build_on_meta(a.rows, a.dim)
    dmp2 = metamat.shard_on_meta(model2, plan=plan_for(model2, "table_wise", world, sharder),
                                 sharders=[sharder])
    report2 = metamat.materialize(dmp2, a.ckpt, device="cpu")
    dense, kjt, _ = batch(a.rows, 1000)
    with torch.no_grad():
        same = torch.allclose(dmp(dense, kjt), dmp2(dense, kjt), rtol=1e-5, atol=1e-6)
    if rank == 0:
        print(report2)
        print(f"reloaded into a table-wise plan: outputs equal to the trained model: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
