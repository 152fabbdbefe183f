"""Models for the TorchRec-on-GPU tests: the same tables sharded for fbgemm's CUDA layout
(``shard_on_meta(compute_device="cuda")``) or for its CPU layout, on any world size.

A *layout* maps each table to (sharding, compute kernel): sharding ``tw``, ``rw``, ``cw``,
``twrw``, ``grid`` (both on host 0), ``dp``; kernel ``fused`` (DEVICE), ``fused_uvm``
(MANAGED), ``fused_uvm_caching`` (MANAGED_CACHING) or ``dense`` (data-parallel tables). :func:`cpu_layout` gives the same
tables on the CPU kernels, whose materialize is the reference (values are plan-invariant).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

Layout = Dict[str, Tuple[str, str]]

# every location and every sharding type of an EmbeddingBagCollection in one model
MIXED: Layout = {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm"),
                 "t2": ("cw", "fused_uvm_caching"), "t3": ("twrw", "fused"),
                 "t4": ("dp", "dense"), "t5": ("rw", "fused_uvm_caching"),
                 "t6": ("tw", "fused_uvm")}
# EmbeddingCollection: TorchRec shards it table-, row- and column-wise
MIXED_EC: Layout = {"t0": ("tw", "fused"), "t1": ("rw", "fused_uvm"),
                    "t2": ("cw", "fused_uvm_caching")}
# EmbeddingCollection on the DENSE kernel (sharded and data-parallel) beside a fused table
DENSE_EC: Layout = {"t0": ("tw", "dense"), "t1": ("rw", "fused_uvm"), "t2": ("cw", "dense"),
                    "t3": ("dp", "dense")}


def cpu_layout(layout: Layout) -> Layout:
    """The same shardings on fbgemm's CPU kernels (UVM kernels become ``fused``)."""
    return {t: (s, "dense" if k == "dense" else "fused") for t, (s, k) in layout.items()}


def rows_of(i: int) -> int:
    return 40 + 7 * i


def dim_of(i: int) -> int:
    return 16 if i % 2 == 0 else 8  # column-wise over 2 ranks: 8 columns a shard


def _sharding(kind: str, world_size: int):
    from torchrec.distributed.sharding_plan import (column_wise, data_parallel, grid_shard,
                                                    row_wise, table_row_wise, table_wise)

    return {"tw": lambda: table_wise(rank=world_size - 1), "rw": row_wise,
            "cw": lambda: column_wise(ranks=list(range(world_size)) if world_size > 1
                                      else [0, 0]),
            "twrw": lambda: table_row_wise(host_index=0),
            "grid": lambda: grid_shard(host_indexes=[0]), "dp": data_parallel}[kind]()


def fused_params(optimizer: str = "EXACT_ROWWISE_ADAGRAD", **extra) -> dict:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {"optimizer": EmbOptimType[optimizer], "learning_rate": 0.05, **extra}


def build(kind: str, layout: Layout, world_size: int, *, data_type: Optional[str] = None,
          optimizer: str = "EXACT_ROWWISE_ADAGRAD", device_type: str = "cuda",
          extra: Optional[dict] = None, device=torch.device("meta")):
    """(module, sharder, ShardingPlan, tables) for ``kind`` in ebc, ec, pec, fpebc, dlrm; the
    plan names ``device_type`` placements and each table's kernel from ``layout`` (one host:
    table-row-wise and grid tables are split over every rank)."""
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                          EmbeddingConfig)
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import DataType

    dt = {"data_type": DataType[data_type]} if data_type else {}
    names = sorted(layout)
    fp = fused_params(optimizer, **(extra or {}))
    path = ""
    if kind in ("ec", "pec"):
        tables = [EmbeddingConfig(name=n, embedding_dim=8, num_embeddings=rows_of(i),
                                  feature_names=[f"f{i}"], **dt) for i, n in enumerate(names)]
        module = plan_module = EmbeddingCollection(tables=tables, device=device)
        sharder = EmbeddingCollectionSharder(fused_params=fp)
        if kind == "pec":  # prioritized embedding communication: row-wise tables only
            from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
            from torchrec.modules.pec_embedding_modules import PECEmbeddingCollection

            module = plan_module = PECEmbeddingCollection(module)
            sharder = PECEmbeddingCollectionSharder(sharder)
    else:
        tables = [EmbeddingBagConfig(name=n, embedding_dim=16 if kind == "dlrm" else dim_of(i),
                                     num_embeddings=rows_of(i),
                                     feature_names=[f"f{i}"], **dt)
                  for i, n in enumerate(names)]
        module = plan_module = EmbeddingBagCollection(tables=tables, device=device,
                                                      is_weighted=kind == "fpebc")
        sharder = EmbeddingBagCollectionSharder(fused_params=fp)
        if kind == "fpebc":
            from torchrec.distributed.fp_embeddingbag import (
                FeatureProcessedEmbeddingBagCollectionSharder)
            from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
            from torchrec.modules.fp_embedding_modules import (
                FeatureProcessedEmbeddingBagCollection)

            proc = PositionWeightedModuleCollection(
                max_feature_lengths={f"f{i}": 4 for i in range(len(names))}, device=device)
            module = FeatureProcessedEmbeddingBagCollection(plan_module, proc)
            plan_module = module
            sharder = FeatureProcessedEmbeddingBagCollectionSharder(sharder)
        elif kind == "dlrm":
            from torchrec.models.dlrm import DLRM

            module = DLRM(embedding_bag_collection=plan_module, dense_in_features=4,
                          dense_arch_layer_sizes=[16, 16], over_arch_layer_sizes=[16, 1],
                          dense_device=device)
            path = "sparse_arch.embedding_bag_collection"
    mp = construct_module_sharding_plan(
        plan_module, {t: _sharding(s, world_size) for t, (s, _) in layout.items()},
        local_size=world_size, world_size=world_size, device_type=device_type, sharder=sharder)
    for t, ps in mp.items():
        ps.compute_kernel = layout[t][1]
    return module, sharder, ShardingPlan({path: mp}), tables


def batch(num_features: int, seed: int, rows: int = 40, size: int = 4, device="cpu"):
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (num_features * size,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(num_features)], values=values, lengths=lengths).to(device)


def local_views(state_dict) -> Dict[str, List[Tuple[Tuple[int, ...], torch.Tensor]]]:
    """{key: [(global offsets, the tensor itself)]} of a state dict's local blocks: TorchRec's
    2D DTensors (a LocalShardsWrapper: none, one or several shards), ShardedTensors, plain."""
    out = {}
    for k, v in state_dict.items():
        local = getattr(v, "_local_tensor", None)
        if local is not None and hasattr(local, "local_offsets"):
            out[k] = [(tuple(int(x) for x in o), t)
                      for o, t in zip(local.local_offsets(), local.local_shards())]
        elif hasattr(v, "local_shards"):
            out[k] = [(tuple(s.metadata.shard_offsets), s.tensor) for s in v.local_shards()]
        elif isinstance(v, torch.Tensor):
            out[k] = [(tuple(0 for _ in v.shape), v)]
    return out


def local_blocks(state_dict) -> Dict[str, List[Tuple[Tuple[int, ...], torch.Tensor]]]:
    """{key: [(offsets, CPU clone)]} of a state dict's local blocks (``local_views``)."""
    return {k: [(o, t.detach().cpu().clone()) for o, t in v]
            for k, v in local_views(state_dict).items()}


def optimizer_blocks(model) -> Dict[str, list]:
    flat = {}
    for pfqn, states in model.fused_optimizer.state_dict()["state"].items():
        for name, v in states.items():
            if isinstance(v, torch.Tensor):
                flat[f"state.{pfqn}.{name}"] = v
    return local_blocks(flat)


def assemble(per_rank: List[Dict[str, list]], key: str, shape, dtype=torch.float32):
    """The global tensor from every rank's blocks (NaN where no rank wrote)."""
    full = torch.full(shape, float("nan"), dtype=dtype)
    for blocks in per_rank:
        for off, t in blocks.get(key, []):
            full[tuple(slice(o, o + s) for o, s in zip(off, t.shape))] = t
    return full


def wrappers(model):
    """Every TorchRec kernel wrapper (BatchedFused/DenseEmbedding[Bag]) of the model."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    out = []
    for m in model.modules():
        if isinstance(m, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            for lookup in m._lookups:
                out.extend(getattr(lookup, "module", lookup)._emb_modules)
    return out


def build_planned(constraints: Dict[str, Tuple[str, str]], world_size: int, local_size: int,
                  *, device_type: str = "cuda", optimizer: str = "EXACT_ROWWISE_ADAGRAD",
                  dim: int = 64):
    """(module, sharder, ShardingPlan, tables): an EmbeddingBagCollection on meta planned by
    TorchRec's own EmbeddingShardingPlanner for ``world_size`` ranks, ``local_size`` a host,
    each table constrained to ``constraints[name] = (sharding type, compute kernel)`` (its
    full names: ``table_column_wise``, ``grid_shard``, ...), column shards of 16."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (EmbeddingShardingPlanner, ParameterConstraints,
                                              Topology)

    names = sorted(constraints)
    tables = [EmbeddingBagConfig(name=n, embedding_dim=dim, num_embeddings=rows_of(i),
                                 feature_names=[f"f{i}"]) for i, n in enumerate(names)]
    module = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params(optimizer))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device_type,
                          local_world_size=local_size),
        constraints={n: ParameterConstraints(sharding_types=[s], compute_kernels=[k],
                                             min_partition=16)
                     for n, (s, k) in constraints.items()})
    plan = planner.collective_plan(module, [sharder], dist.group.WORLD)
    return module, sharder, plan, tables


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16,
                                1: torch.uint8}[t.element_size()])


def block_mismatches(blocks: Dict[str, list], full: Dict[str, torch.Tensor]) -> List[str]:
    """Keys of ``blocks`` ({key: [(offsets, tensor)]}) whose bits differ from the same block
    of the whole tensors ``full`` (an unsharded model's state_dict, on the CPU)."""
    return sorted({k for k, bs in blocks.items() for off, t in bs if not torch.equal(
        bits(t.detach().cpu()), bits(full[k][tuple(slice(o, o + n)
                                                    for o, n in zip(off, t.shape))]))})


def memory_kind(t: torch.Tensor) -> str:
    """A CUDA tensor's memory: fbgemm's unified memory, host-mapped or managed (as CUDA
    reports the pointer; fbgemm's is_uvm_tensor holds for both), or plain device memory."""
    from metamat import _C

    if not torch.ops.fbgemm.is_uvm_tensor(t):
        return "device"
    return "host-mapped" if _C.host_pointer(t.untyped_storage().data_ptr()) else "managed"


#: A fused TBE's plain attributes its constructor computes, compared with fbgemm's own (the
#: CPU kernels ignore info_B_*, the CUDA backward decodes its (table, batch) index with them)
TBE_SCALARS = ("info_B_num_bits", "info_B_mask", "total_D", "max_D", "total_hash_size",
               "total_hash_size_bits", "total_cache_hash_size", "max_D_cache", "timestep")


def fbgemm_mismatches(model) -> list:
    """Every buffer of each fused TBE (metadata, cache, counters, optimizer state) and its
    computed scalars (:data:`TBE_SCALARS`) against the same TBE built for real by
    fbgemm-gpu-cpu on the CPU with the same CUDA specs; the weights excepted (their values
    are metamat's)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen as TBE)

    bad = []
    for w in wrappers(model):
        emb = w._emb_module
        if not isinstance(emb, TBE):
            continue
        cached = emb.lxu_cache_weights.numel() > 0
        cache = dict(cache_sets=emb.lxu_cache_state.shape[0] if cached else 1,
                     cache_precision=SparseType.from_dtype(emb.lxu_cache_weights.dtype))
        ref = TBE(list(emb.embedding_specs), feature_table_map=list(emb.feature_table_map),
                  optimizer=emb.optimizer, weights_precision=emb.weights_precision,
                  cache_algorithm=emb.cache_algorithm, uvm_host_mapped=emb.uvm_host_mapped,
                  device=torch.device("cpu"), pooling_mode=emb.pooling_mode, **cache)
        mine = dict(emb.named_buffers())
        for name, want in ref.named_buffers():
            have = mine.get(name)
            if name.startswith("weights_"):
                continue
            if have is None or have.shape != want.shape or have.dtype != want.dtype \
                    or not torch.equal(bits(have.cpu()), bits(want)):
                bad.append(name)
        for name, p in ref.named_parameters():  # momentum (zeros), empty weight buffers
            if not name.startswith("weights_") and not torch.equal(getattr(emb, name), p):
                bad.append(name)
        for name in TBE_SCALARS:
            if hasattr(ref, name) and getattr(emb, name, None) != getattr(ref, name):
                bad.append(f"{name}={getattr(emb, name, None)} (fbgemm: {getattr(ref, name)})")
    return bad


def forward(model, batch) -> torch.Tensor:
    """One tensor of a TorchRec model's output (pooled values, or an EmbeddingCollection's
    sequence values in feature order)."""
    out = model(batch)
    out = out.wait() if hasattr(out, "wait") else out
    if isinstance(out, dict):  # EmbeddingCollection: {feature: JaggedTensor}
        return torch.cat([out[k].values() for k in sorted(out)])
    return out.values() if hasattr(out, "values") and callable(out.values) else out


def backward(model, batch) -> torch.Tensor:
    """A forward and backward: fused kernels update their tables and state in backward."""
    out = forward(model, batch)
    (out * out).sum().backward()
    return out


def train_step(model, batch) -> torch.Tensor:
    """``backward``, then plain SGD on what has a gradient (data-parallel tables); the
    forward's output, on the CPU."""
    out = backward(model, batch)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-0.05)
                p.grad = None
    return out.detach().cpu()


def global_of(per_rank: List[Dict[str, list]], key: str) -> torch.Tensor:
    """The global tensor of ``key`` from the ranks' blocks (its shape: the blocks' extent)."""
    blocks = [b for r in per_rank for b in r.get(key, [])]
    shape = [max(o[d] + t.shape[d] for o, t in blocks) for d in range(blocks[0][1].dim())]
    return assemble(per_rank, key, shape, dtype=blocks[0][1].dtype)


def assert_same(a_ranks, b_ranks, what: str, keys=None) -> None:
    """Every key's global tensor (``keys``, default all of ``a_ranks``): the same shape and
    bits on both sides, every row and column written."""
    keys = keys or sorted({k for r in a_ranks for k in r})
    assert keys, what
    for k in keys:
        a, b = global_of(a_ranks, k), global_of(b_ranks, k)
        assert a.shape == b.shape, f"{what} {k}: {a.shape} vs {b.shape}"
        assert not torch.isnan(a.float()).any(), f"{what} {k}: rows or columns not written"
        assert torch.equal(bits(a), bits(b)), f"{what} {k} differs"
