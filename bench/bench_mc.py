"""--mode mc: a managed-collision (zero-collision hashing) EmbeddingBagCollection, 2 gloo ranks:
TorchRec's eager DistributedModelParallel against shard_on_meta + metamat.materialize, from
nothing (init) and from a DCP checkpoint (load: eager DMP + ``dcp.load`` + ``load_state_dict``,
TorchRec's way), with peak RSS.

The model: --tables tables of dim --dim, each with an MCH module (DistanceLFU eviction) whose
slots are the table's rows, all row-wise (the only sharding TorchRec gives them), FUSED kernel
with row-wise Adagrad. The bytes are the rank's tables, optimizer state and remapping state
(int64 raw ids, slot rows and eviction counters: 32 bytes per row). ``--zch hash``: multi-probe
HashZch modules instead (TTL eviction, one bucket per rank: an int64 id and an int32 eviction
time per row, 12 bytes). Each method runs in its
own rank processes; the slowest rank sets each rep's time. The ceiling: ``fill_`` of the
rank's bytes into fresh pages in one process (every method writes each byte at least once).
"""
from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _common import Row, finish, print_table, progress  # noqa: E402
from bench_dmp import _fill_ceiling, _rss_gib, sharder, table_configs  # noqa: E402

HASH = 2**40  # raw ids: any int64 below this


def _zch_modules(cfgs, device: torch.device, zch: str, world: int) -> dict:
    if zch == "hash":
        from torchrec.modules.hash_mc_evictions import (HashZchEvictionConfig,
                                                        HashZchEvictionPolicyName)
        from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

        return {c.name: HashZchManagedCollisionModule(
            zch_size=c.num_embeddings, device=device, total_num_buckets=world, name=c.name,
            eviction_policy_name=HashZchEvictionPolicyName.SINGLE_TTL_EVICTION,
            eviction_config=HashZchEvictionConfig(features=c.feature_names, single_ttl=24))
            for c in cfgs}
    from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, MCHManagedCollisionModule

    return {c.name: MCHManagedCollisionModule(zch_size=c.num_embeddings, device=device,
                                              eviction_policy=DistanceLFU_EvictionPolicy(),
                                              eviction_interval=100, input_hash_size=HASH)
            for c in cfgs}


def mc_module(cfgs, device: torch.device, zch: str = "mch", world: int = 1):
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    mcs = _zch_modules(cfgs, device, zch, world)
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=cfgs, device=device),
        ManagedCollisionCollection(mcs, embedding_configs=cfgs), return_remapped_features=False)


def mc_sharder(kernel: str):
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder

    return ManagedCollisionEmbeddingBagCollectionSharder(sharder(kernel))


def mc_plan(module, world: int, kernel: str, shd):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan

    tables = [c.name for c in module._embedding_module.embedding_bag_configs()]
    mp = construct_module_sharding_plan(
        module, per_param_sharding={t: row_wise(compute_kernel=kernel) for t in tables},
        local_size=world, world_size=world, device_type="cpu", sharder=shd)
    return ShardingPlan({"": mp})


def _rank(rank: int, world: int, method: str, per_rank: int, n_tables: int, dim: int,
          reps: int, threads: int, kernel: str, ckpt: str, zch: str = "mch"):
    import resource

    from _quiet import quiet
    quiet()

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    torch.set_num_threads(threads)
    # the MC state adds 32 (12) bytes per row: tables get the rest of the rank's bytes
    itemsize_row = dim * 4 + (4 if kernel == "fused" else 0) + (12 if zch == "hash" else 32)
    cfgs = table_configs(per_rank * dim * 4 // itemsize_row, n_tables, dim, world, torch.float32)
    for c in cfgs:  # whole buckets per rank (HashZch; harmless for MCH)
        c.num_embeddings -= c.num_embeddings % world
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    if method == "save":  # the checkpoint both load methods read
        module = mc_module(cfgs, torch.device("cpu"), zch, world)
        shd = mc_sharder(kernel)
        model = DistributedModelParallel(module, env=env, device=torch.device("cpu"),
                                         plan=mc_plan(module, world, kernel, shd), sharders=[shd])
        dcp.save(model.state_dict(), checkpoint_id=ckpt)
        return {}
    start_rss = _rss_gib()
    times, local_bytes = [], 0
    for _ in range(reps):
        gc.collect()  # DMP holds reference cycles: the previous rep's model goes first
        dist.barrier()
        t0 = time.perf_counter()
        shd = mc_sharder(kernel)
        if method.startswith("torchrec"):
            module = mc_module(cfgs, torch.device("cpu"), zch, world)
            model = DistributedModelParallel(module, env=env, device=torch.device("cpu"),
                                             plan=mc_plan(module, world, kernel, shd),
                                             sharders=[shd])
            if method == "torchrec-load":
                sd = model.state_dict()
                dcp.load(sd, checkpoint_id=ckpt)
                model.load_state_dict(sd)
        else:
            module = mc_module(cfgs, torch.device("meta"), zch, world)
            model = metamat.shard_on_meta(module, env=env, plan=mc_plan(module, world, kernel, shd),
                                          sharders=[shd])
            report = metamat.materialize(model, ckpt if method == "metamat-load" else None,
                                         device=torch.device("cpu"), seed=0)
            local_bytes = report.bytes_allocated
        times.append(time.perf_counter() - t0)
        del model, module
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"median_s": statistics.median(times), "peak_rss_growth": peak - start_rss,
            "bytes": local_bytes}


def run_mc(a, device: torch.device) -> List[Row]:
    from _dist import run_dist

    if device.type != "cpu":
        print("mc mode: measures the CPU (TorchRec's MC eviction needs fbgemm's CUDA kernels, "
              "its materialization does not)")
    per_rank = int(a.size_gib * 2**30)
    threads = max(1, (os.cpu_count() or 2) // a.ranks)
    kernel = getattr(a, "kernel", "fused")
    zch = getattr(a, "zch", "mch")
    tmp = tempfile.mkdtemp(prefix="metamat-mc-")
    rows: List[Row] = []
    try:
        ckpt = os.path.join(tmp, "ckpt")
        progress("mc: writing the checkpoint (eager DMP + dcp.save)")
        run_dist(_rank, a.ranks, "save", per_rank, a.tables, a.dim, 1, threads, kernel, ckpt,
                 zch)
        for what, methods in (("init", (("torchrec", "TorchRec DMP(device=cpu)"),
                                          ("metamat", "metamat shard_on_meta+materialize"))),
                              ("load", (("torchrec-load", "TorchRec DMP + dcp.load"),
                                        ("metamat-load", "metamat materialize(ckpt)")))):
            part = []
            for method, label in methods:
                progress(f"mc {what}: {label}, {a.reps} reps")
                res = run_dist(_rank, a.ranks, method, per_rank, a.tables, a.dim, a.reps,
                               threads, kernel, ckpt, zch)
                part.append(Row(f"mc-{what}", label, res[0]["bytes"],
                                max(r["median_s"] for r in res), a.reps,
                                peak_rss_gib=max(r["peak_rss_growth"] for r in res),
                                extra=f"{a.ranks} ranks, {zch} modules, {kernel} kernel, "
                                      "per-rank bytes, "
                                      f"{threads} thread(s)/rank"))
            part[0].nbytes = part[1].nbytes  # same model: metamat's count of local bytes
            ceiling = _fill_ceiling(part[1].nbytes, a.reps, threads)
            ceiling.mode = f"mc-{what}"
            part.append(ceiling)
            finish(part, part[0].method, ceiling.method)
            print_table(f"mc {what}: {a.tables} MC tables ({zch}), dim {a.dim}, ~{a.size_gib:g} GiB/rank, "
                        f"{a.ranks} ranks", part, part[0].method, ceiling.method)
            rows += part
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows
