"""--mode dmp: TorchRec's eager DistributedModelParallel materialization against
shard_on_meta + metamat.materialize, same tables and plan, 2 gloo ranks, with peak RSS.

The model (also --mode load's): an EmbeddingBagCollection of --tables tables sharded RW x2,
CW, TW x2 with TorchRec's FUSED compute kernel and a row-wise Adagrad optimizer
(``EmbOptimType.EXACT_ROWWISE_ADAGRAD`` in the sharder's fused params), so the fused
optimizer state (one fp32 momentum per local row) is part of what is materialized, saved and
loaded; ``--kernel dense`` uses the DENSE kernel instead (no optimizer state).

Each method runs in its own set of rank processes, so peak RSS (growth over the process's RSS
before the model is built) belongs to that method alone. The goal's ceiling is ``fill_`` of the
same bytes into fresh pages, timed three ways: in one process alone, in every rank process at
once, and paired with metamat's reps inside its own rank processes (a ``fill_`` after or
before each rep, alternating). This VM's first-touch cost moves between runs by as much as the
goal's margin; a pair shares it, so the median of the pairs' ratios is the steadiest figure.
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _common import Row, finish, print_table, progress, timeit  # noqa: E402

# The plan of the measured baseline in the notes: RW x2, CW, TW x2.
SHARDING = ["row_wise", "row_wise", "column_wise", "table_wise", "table_wise"]


def table_configs(total_bytes_per_rank: int, n_tables: int, dim: int, world: int, dtype):
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(world * 8, int(total_bytes_per_rank * world / (n_tables * dim * itemsize)))
    dt = {torch.float32: DataType.FP32, torch.float16: DataType.FP16}[dtype]
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                               feature_names=[f"f{i}"], data_type=dt) for i in range(n_tables)]


def sharder(kernel: str = "fused"):
    """The EBC sharder: FUSED tables carry a row-wise Adagrad state (fused params)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = ({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
             if kernel == "fused" else None)
    return EmbeddingBagCollectionSharder(fused_params=fused)


def build_plan(ebc, world: int, kernel: str = "fused", shd=None):
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    row_wise, table_wise)
    from torchrec.distributed.types import ShardingPlan

    per = {}
    for i, cfg in enumerate(ebc.embedding_bag_configs()):
        kind = SHARDING[i % len(SHARDING)]
        per[cfg.name] = (row_wise() if kind == "row_wise" else
                         column_wise(ranks=list(range(world))) if kind == "column_wise" else
                         table_wise(rank=i % world))
    mp = construct_module_sharding_plan(ebc, per_param_sharding=per, local_size=world,
                                        world_size=world, device_type="cpu",
                                        sharder=shd or sharder(kernel))
    for ps in mp.values():
        if ps.sharding_type != "data_parallel":
            ps.compute_kernel = kernel  # construct_module_sharding_plan picks DENSE
    return ShardingPlan({"": mp})


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 2**20


def _rank(rank: int, world: int, method: str, per_rank: int, n_tables: int, dim: int,
          reps: int, dtype_name: str, threads: int, kernel: str):
    import resource

    from _quiet import quiet
    quiet()

    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import metamat

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    cfgs = table_configs(per_rank, n_tables, dim, world, dtype)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    start_rss = _rss_gib()
    times, fills, local_bytes = [], [], 0
    for i in range(reps):
        gc.collect()  # DMP holds reference cycles: the previous rep's model goes first
        if method == "metamat" and i % 2 == 1:  # paired fill_, before this rep (after the last)
            fills.append(_timed_fill(dist, local_bytes))
        dist.barrier()
        t0 = time.perf_counter()
        ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
        shd = sharder(kernel)
        plan = build_plan(ebc, world, kernel, shd)
        if method == "torchrec":
            model = DistributedModelParallel(ebc, env=env, device=torch.device("cpu"), plan=plan,
                                             sharders=[shd])
        else:
            model = metamat.shard_on_meta(ebc, env=env, plan=plan, sharders=[shd])
            report = metamat.materialize(model, device=torch.device("cpu"), seed=0)
            local_bytes = report.bytes_allocated  # the rank's model bytes (TorchRec's too)
        times.append(time.perf_counter() - t0)
        del model, ebc
        if method == "metamat" and i % 2 == 0:
            gc.collect()
            fills.append(_timed_fill(dist, local_bytes))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"median_s": statistics.median(times), "peak_rss_growth": peak - start_rss,
            "bytes": local_bytes, "times": times, "fills": fills}


def _timed_fill(dist, nbytes: int) -> float:
    """Seconds of ``fill_`` of ``nbytes`` into fresh pages, all ranks at once: the ceiling
    paired with one of metamat's reps in the same processes (this VM's first-touch cost moves
    from run to run as much as the goal's margin; a pair shares it)."""
    dist.barrier()
    t0 = time.perf_counter()
    torch.empty(max(1, nbytes // 4)).fill_(0.5)
    return time.perf_counter() - t0


def _fill_ceiling(nbytes: int, reps: int, threads: int) -> Row:
    """fill_ of one rank's bytes with one rank's threads, into fresh pages: what writing
    a rank's shards costs at best (materialize, too, writes freshly allocated memory)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = max(1, nbytes // 4)
        sec = timeit(lambda: torch.empty(n).fill_(0.5), reps, torch.device("cpu"))
    finally:
        torch.set_num_threads(old)
    from _common import peak_rss_gib
    return Row("dmp", "torch fill_ (per-rank ceiling)", n * 4, sec, reps,
               peak_rss_gib=peak_rss_gib(), extra=f"fresh pages, {threads} thread(s)")


def _fill_rank(rank: int, world: int, nbytes: int, reps: int, threads: int):
    import resource

    import torch.distributed as dist

    torch.set_num_threads(threads)
    n = max(1, nbytes // 4)
    start_rss = _rss_gib()
    torch.empty(n).fill_(0.5)  # untimed first call, as timeit does for the one-process row
    times = []
    for _ in range(reps):
        dist.barrier()  # all ranks write at once, as the methods' ranks do
        t0 = time.perf_counter()
        torch.empty(n).fill_(0.5)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return statistics.median(times), peak - start_rss  # growth, as the methods' rows report


def _fill_ceiling_ranks(nbytes: int, reps: int, threads: int, ranks: int) -> Row:
    """The same fill_ in every rank process at once (slowest rank's median): the ranks of the
    methods above share the machine's cores and its page-fault path too; on a box with fewer
    free cores than ranks x threads this ceiling is lower than the one-process one."""
    from _dist import run_dist

    res = run_dist(_fill_rank, ranks, nbytes, reps, threads)
    return Row("dmp", "torch fill_ (ranks at once)", max(1, nbytes // 4) * 4,
               max(r[0] for r in res), reps, peak_rss_gib=max(r[1] for r in res),
               extra=f"fresh pages, {ranks} ranks at once, {threads} thread(s)/rank")


def run_dmp(a, device: torch.device) -> List[Row]:
    from _dist import run_dist

    if device.type != "cpu":
        print("dmp mode: the TorchRec baseline runs on CPU here (fbgemm-gpu-cpu); measuring CPU")
    per_rank = int(a.size_gib * 2**30)
    threads = max(1, (os.cpu_count() or 2) // a.ranks)
    rows = []
    kernel = getattr(a, "kernel", "fused")
    for method, label in (("torchrec", "TorchRec DMP(device=cpu)"),
                          ("metamat", "metamat shard_on_meta+materialize")):
        progress(f"dmp: {label} ({kernel} kernel), {a.reps} reps")
        res = run_dist(_rank, a.ranks, method, per_rank, a.tables, a.dim, a.reps, a.dtype, threads,
                       kernel)
        sec = max(r["median_s"] for r in res)  # the slowest rank sets the wall time
        rows.append(Row("dmp", label, res[0]["bytes"], sec, a.reps,
                        peak_rss_gib=max(r["peak_rss_growth"] for r in res),
                        extra=f"{a.ranks} ranks, {kernel} kernel, per-rank bytes, "
                              f"{threads} thread(s)/rank"))
    # metamat's reps, each with a fill_ of its bytes in the same processes (alternating which
    # goes first); the slowest rank sets both times of a pair
    pairs = [(max(r["times"][i] for r in res), max(r["fills"][i] for r in res))
             for i in range(a.reps)]
    rows[0].nbytes = rows[1].nbytes  # same tables and plan: metamat's count of local bytes
    rows.append(_fill_ceiling(rows[1].nbytes, a.reps, threads))
    progress(f"dmp: torch fill_ in {a.ranks} rank processes at once, {a.reps} reps")
    rows.append(_fill_ceiling_ranks(rows[1].nbytes, a.reps, threads, a.ranks))
    rows.append(Row("dmp", "torch fill_ (paired with metamat)", rows[1].nbytes,
                    statistics.median(f for _, f in pairs), a.reps,
                    peak_rss_gib=rows[1].peak_rss_gib,
                    extra=f"fresh pages, in metamat's {a.ranks} rank processes between its reps "
                          "(RSS: those processes')"))
    finish(rows, "TorchRec DMP(device=cpu)", "torch fill_ (per-rank ceiling)")
    print_table(f"dmp: {a.tables} tables, dim {a.dim}, {kernel} kernel, ~{a.size_gib:g} GiB/rank, "
                f"{a.ranks} ranks",
                rows, "TorchRec DMP(device=cpu)", "torch fill_ (per-rank ceiling)")
    ours = rows[1].seconds
    ratios = sorted(m / f for m, f in pairs)
    print(f"metamat's time / fill_ ceiling: {ours / rows[2].seconds:.2f}x one process alone, "
          f"{ours / rows[3].seconds:.2f}x with all {a.ranks} ranks writing at once, "
          f"{statistics.median(ratios):.2f}x paired (median of {len(ratios)} same-process "
          f"pairs, {ratios[0]:.2f}-{ratios[-1]:.2f}x)")
    return rows
