"""DLRM on meta -> materialize -> train -> dcp.save -> reload into another plan.

    torchrun --nproc_per_node 2 examples/dlrm_meta.py      # 2 ranks (gloo, CPU)
    python examples/dlrm_meta.py                           # 1 rank

1. The DLRM is built on meta and sharded row-wise with TorchRec's FUSED kernel and a fused
   row-wise Adagrad optimizer (``EXACT_ROWWISE_ADAGRAD``): nothing of the tables exists yet.
2. ``metamat.materialize`` allocates each rank's shards and writes them once.
3. A few training steps: the tables (and their Adagrad momentum) are updated by the fused
   optimizer inside the backward pass, the dense layers by SGD.
4. ``dcp.save`` of the model and the fused optimizer, as TorchRec users save.
5. A second DLRM, on meta and sharded table-wise, is materialized from that checkpoint: each
   rank reads only the bytes of its tables.
6. The reloaded model must equal the trained one: every table, every optimizer state, every
   dense parameter and the forward output. The script exits 1 if anything differs.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                table_wise)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM

import metamat

FEATURES = 4
FUSED = EmbeddingComputeKernel.FUSED.value


def build_on_meta(rows: int, dim: int) -> DLRM:
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                 feature_names=[f"f{i}"]) for i in range(FEATURES)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=8, dense_arch_layer_sizes=[32, dim],
                over_arch_layer_sizes=[32, 1], dense_device=torch.device("meta"))


def plan_for(model: DLRM, kind: str, world: int, sharder) -> ShardingPlan:
    """Every table row-wise or table-wise, all with the FUSED kernel (the fused optimizer)."""
    ebc = model.sparse_arch.embedding_bag_collection
    if kind == "row_wise":
        per = {f"t{i}": row_wise(compute_kernel=FUSED) for i in range(FEATURES)}
    else:
        per = {f"t{i}": table_wise(rank=i % world, compute_kernel=FUSED) for i in range(FEATURES)}
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


def snapshot(model) -> dict:
    """Every table, dense parameter and fused optimizer state, whole, by name, on every rank.

    Each rank contributes the shards it holds (a rank holds optimizer state only for its own
    tables); the whole values are assembled from all of them, so two models sharded with
    different plans compare entry by entry.
    """
    entries = dict(model.state_dict())
    for param, states in model.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            entries[f"optim/{param}/{name}"] = value
    mine = {}
    for key, t in entries.items():
        if hasattr(t, "local_shards"):  # a ShardedTensor: this rank's pieces of it
            pieces = [(s.metadata.shard_offsets, s.tensor.detach().clone()) for s in t.local_shards()]
            mine[key] = (tuple(t.size()), pieces)
        else:  # a plain (replicated) tensor
            mine[key] = (tuple(t.shape), [([0] * t.dim(), t.detach().clone())])
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

    # 1-2. Build on meta, shard row-wise (FUSED), materialize: each rank writes its shards once.
    model = build_on_meta(a.rows, a.dim)
    dmp = metamat.shard_on_meta(model, plan=plan_for(model, "row_wise", world, sharder),
                                sharders=[sharder])
    report = metamat.materialize(dmp, device="cpu", seed=0)
    if rank == 0:
        print(report)
    before = snapshot(dmp)

    # 3. Train: the tables by the fused optimizer (in backward), the dense layers by SGD.
    dense = [p for n, p in dmp.named_parameters() if "embedding_bag" not in n]
    opt = torch.optim.SGD(dense, lr=0.05)
    for step in range(a.steps):
        x, kjt, label = batch(a.rows, step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(x, kjt).squeeze(-1), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    trained = snapshot(dmp)
    tables = [k for k in trained if k.endswith(".weight") and "embedding_bags" in k]
    momenta = [k for k in trained if k.startswith("optim/")]
    changed = sum(not torch.equal(before[k], trained[k]) for k in tables)
    nonzero = sum(bool(trained[k].abs().sum() > 0) for k in momenta)
    if rank == 0:
        print(f"trained by the fused optimizer: {changed} of {len(tables)} tables changed, "
              f"{nonzero} of {len(momenta)} row-wise Adagrad states non-zero")

    # 4. Save model and fused optimizer with torch.distributed.checkpoint.
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
             checkpoint_id=a.ckpt)

    # 5. Reload into a different plan (table-wise): each rank reads only its tables' bytes.
    model2 = build_on_meta(a.rows, a.dim)
    dmp2 = metamat.shard_on_meta(model2, plan=plan_for(model2, "table_wise", world, sharder),
                                 sharders=[sharder])
    report2 = metamat.materialize(dmp2, a.ckpt, device="cpu")
    if rank == 0:
        print(report2)

    # 6. Everything equal: tables, optimizer state, dense parameters, outputs.
    reloaded = snapshot(dmp2)
    differ = sorted(k for k in trained if k not in reloaded or not torch.equal(trained[k], reloaded[k]))
    x, kjt, _ = batch(a.rows, 1000)
    with torch.no_grad():
        same_out = torch.equal(dmp(x, kjt), dmp2(x, kjt))
    ok = (changed == len(tables) and nonzero == len(momenta) > 0 and not differ and same_out
          and set(reloaded) == set(trained))
    if rank == 0:
        print(f"reloaded into a table-wise plan: {len(trained)} tensors "
              f"({len(tables)} tables, {len(momenta)} optimizer states) equal: {not differ}; "
              f"outputs equal: {same_out}")
        if differ:
            print("differ:", differ)
        print("OK" if ok else "FAILED")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
