"""A checkpoint saved by eager TorchRec, loaded by metamat into a model on meta with another plan.

    torchrun --nproc_per_node 2 examples/torchrec_load_plan.py   # 2 ranks (gloo, CPU)
    python examples/torchrec_load_plan.py                        # 1 rank

1. "Training job": an eager ``DistributedModelParallel`` with every table row-wise (FUSED
   kernel, fused row-wise Adagrad), some values written into it, then ``dcp.save`` of the
   model and its fused optimizer: the checkpoint a TorchRec job leaves behind.
2. "Next job": the same tables built on meta and sharded with a different plan (one table
   table-wise, one column-wise, one data-parallel); ``metamat.materialize(model, ckpt)``
   reads each rank's rows and columns of the saved chunks and nothing else.
3. Every table and optimizer state equals the saved one (row-wise state of the column-wise
   table: one copy per column shard, as TorchRec keeps it). ``Report`` says what was read.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                data_parallel, row_wise, table_wise)
from torchrec.distributed.types import ShardingEnv, ShardingPlan

import metamat

NAMES = ("user", "item", "ad")
FUSED = EmbeddingComputeKernel.FUSED.value  # tables updated by the fused optimizer


def tables(rows: int, dim: int):
    return [EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows * (i + 1),
                               feature_names=[f"{n}_id"]) for i, n in enumerate(NAMES)]


def plan(ebc, per: dict, world: int, sharder) -> ShardingPlan:
    mp = construct_module_sharding_plan(ebc, per, local_size=world, world_size=world,
                                        device_type="cpu", sharder=sharder)
    return ShardingPlan({"": mp})


def whole(entries: dict) -> dict:
    """Every entry's whole value, assembled from the shards every rank holds."""
    mine = {}
    for key, t in entries.items():
        if hasattr(t, "local_shards"):
            mine[key] = (tuple(t.size()),
                         [(s.metadata.shard_offsets, s.tensor.detach().clone())
                          for s in t.local_shards()])
        else:
            mine[key] = (tuple(t.shape), [([0] * t.dim(), t.detach().clone())])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict = {}
    for theirs in everyone:
        for key, (size, pieces) in theirs.items():
            for offsets, piece in pieces:
                o = out.setdefault(key, torch.zeros(size, dtype=piece.dtype))
                o[tuple(slice(a, a + n) for a, n in zip(offsets, piece.shape))] = piece
    return out


def same(got: torch.Tensor, saved: torch.Tensor) -> bool:
    if got.shape == saved.shape:
        return torch.equal(got, saved)
    # Row-wise optimizer state of a column-wise table: TorchRec keeps one accumulator per row
    # per column shard (rows * k); each shard starts from the saved row's value.
    k = got.numel() // saved.numel()
    return got.numel() == k * saved.numel() and torch.equal(got, saved.repeat(k))


def tables_and_momenta(model) -> dict:
    entries = dict(model.state_dict())
    for param, states in model.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            entries[f"optim/{param}/{name}"] = value
    return whole(entries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="/tmp/metamat_torchrec_ckpt")
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=32)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                            world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})

    # 1. The training job's checkpoint: eager TorchRec, every table row-wise.
    ebc = EmbeddingBagCollection(tables=tables(a.rows, a.dim), device=torch.device("meta"))
    eager = DistributedModelParallel(
        ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
        plan=plan(ebc, {n: row_wise(compute_kernel=FUSED) for n in NAMES}, world, sharder), sharders=[sharder])
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():  # stand-in for training: every shard and momentum gets new values
        for t in eager.state_dict().values():
            for s in t.local_shards():
                s.tensor.copy_(torch.randn(s.tensor.shape, generator=g))
        for states in eager.fused_optimizer.state_dict()["state"].values():
            for t in states.values():
                for s in t.local_shards():
                    s.tensor.copy_(torch.rand(s.tensor.shape, generator=g))
    dcp.save({"model": eager.state_dict(), "optim": eager.fused_optimizer.state_dict()},
             checkpoint_id=a.ckpt)
    saved = tables_and_momenta(eager)

    # 2. The next job: on meta, another plan, loaded by metamat.
    ebc2 = EmbeddingBagCollection(tables=tables(a.rows, a.dim), device=torch.device("meta"))
    ranks = list(range(world)) if world > 1 else [0, 0]
    other = plan(ebc2, {"user": table_wise(rank=world - 1, compute_kernel=FUSED),
                        "item": column_wise(ranks=ranks, compute_kernel=FUSED),
                        "ad": data_parallel()}, world, sharder)
    model = metamat.shard_on_meta(ebc2, plan=other, sharders=[sharder])
    # The data-parallel table has no fused optimizer (DDP trains it), so its saved momentum
    # has no place in this model: say so, or strict loading refuses it as unexpected.
    report = metamat.materialize(model, a.ckpt, device="cpu",
                                 ignore_unexpected=["optim.state.*.ad.momentum1"])
    print(f"rank {rank}: read {report.bytes_read:,} bytes for {report.bytes_needed:,} needed "
          f"(amplification {report.read_amplification:.3f}); loaded {len(report.loaded)} tensors")

    # 3. Compare: every table, and the momentum of every table that has a fused optimizer.
    loaded = tables_and_momenta(model)
    differ = sorted(k for k in loaded if not same(loaded[k], saved[k]))
    ok = not differ and len(loaded) == 2 * len(NAMES) - 1
    if rank == 0:
        print(f"{len(loaded)} tables and optimizer states equal to the saved ones: {not differ}")
        print("OK" if ok else f"FAILED: {differ}")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
