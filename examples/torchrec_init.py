"""TorchRec tables built on meta and initialised by metamat: the same values on any plan.

    torchrun --nproc_per_node 2 examples/torchrec_init.py      # 2 ranks (gloo, CPU)
    python examples/torchrec_init.py                           # 1 rank

1. An EmbeddingBagCollection is built on meta (nothing allocated) and sharded by TorchRec's
   own planner with ``metamat.shard_on_meta``.
2. ``metamat.materialize(model, seed=0)`` allocates each rank's shards and writes them once:
   every element is a pure function of (seed, table name, row, column).
3. The same tables sharded by another plan (column-wise) get the same values, and so does
   one unsharded tensor filled with ``metamat.fill_`` (what any world size would give).
"""
from __future__ import annotations

import argparse
import os
from functools import partial

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan

import metamat


def tables(rows: int, dim: int):
    # init_fn as TorchRec users write it; metamat fuses the distributions it knows
    return [EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=rows,
                               feature_names=["user_id"],
                               init_fn=partial(torch.nn.init.normal_, mean=0.0, std=0.01)),
            EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=2 * rows,
                               feature_names=["item_id"],
                               init_fn=partial(torch.nn.init.uniform_, a=-0.05, b=0.05))]


def whole_tables(model) -> dict:
    """Each table's whole value, assembled from the shards every rank holds."""
    mine = {}
    for key, t in model.state_dict().items():
        mine[key] = (tuple(t.size()),
                     [(s.metadata.shard_offsets, s.tensor.clone()) for s in t.local_shards()])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    whole: dict = {}
    for theirs in everyone:
        for key, (size, pieces) in theirs.items():
            for offsets, piece in pieces:
                out = whole.setdefault(key, torch.zeros(size, dtype=piece.dtype))
                out[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    return whole


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1-2. TorchRec's planner decides the plan; metamat writes each local shard once.
    ebc = EmbeddingBagCollection(tables=tables(a.rows, a.dim), device=torch.device("meta"))
    model = metamat.shard_on_meta(ebc, compute_device="cpu")
    report = metamat.materialize(model, seed=0, device="cpu")
    if rank == 0:
        print(report)
    planned = whole_tables(model)

    # 3. Another plan: every table column-wise over all ranks.
    sharder = EmbeddingBagCollectionSharder()
    ebc2 = EmbeddingBagCollection(tables=tables(a.rows, a.dim), device=torch.device("meta"))
    ranks = list(range(world)) if world > 1 else [0, 0]
    mp = construct_module_sharding_plan(ebc2, {"user": column_wise(ranks=ranks),
                                               "item": column_wise(ranks=ranks)},
                                        local_size=world, world_size=world, device_type="cpu",
                                        sharder=sharder)
    model2 = metamat.shard_on_meta(ebc2, plan=ShardingPlan({"": mp}), sharders=[sharder])
    metamat.materialize(model2, seed=0, device="cpu")
    column_wise_values = whole_tables(model2)

    # ... and one unsharded tensor per table, filled by the init engine directly.
    reference = {}
    for cfg, d in ((tables(a.rows, a.dim)[0], metamat.Normal(0.0, 0.01)),
                   (tables(a.rows, a.dim)[1], metamat.Uniform(-0.05, 0.05))):
        t = torch.empty(cfg.num_embeddings, cfg.embedding_dim)
        reference[f"embedding_bags.{cfg.name}.weight"] = metamat.fill_(t, d, seed=0, key=cfg.name)

    same_plan = all(torch.equal(planned[k], column_wise_values[k]) for k in planned)
    same_ref = all(torch.equal(planned[k], reference[k]) for k in reference)
    if rank == 0:
        for k, v in planned.items():
            print(f"{k}: {tuple(v.shape)}, mean {v.mean():+.5f}, std {v.std():.5f}")
        print(f"planner's plan == column-wise plan: {same_plan}; "
              f"== one unsharded fill_: {same_ref}")
        print("OK" if same_plan and same_ref else "FAILED")
    dist.destroy_process_group()
    if not (same_plan and same_ref):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
