"""--mode load: load a DCP checkpoint into the bench_dmp model (~2 GiB/rank, 2 gloo ranks)
three ways, in the same run:

* TorchRec eager DMP + ``dcp.load`` (the baseline: building the eager DMP is timed too, as
  metamat's time includes sharding on meta; "dcp.load only" times the load alone);
* eager DMP + ``torch.load(mmap=True)`` of each rank's own torch.save'd local shards +
  ``copy_`` into the existing tensors (the "already laid out per rank" upper bound);
* ``shard_on_meta`` + ``metamat.materialize(model, ckpt)`` (plan, allocate, read, register;
  the timed region includes sharding on meta);
* the same with ``verify=True`` (every byte read checked against the checkpoint's xxh3
  sidecar while streaming; the sidecar is written once after saving, not timed). Its row
  reports the overhead over the row without verification.

The checkpoint is written once by an eager DMP (one process group, which also measures the
memcpy ceiling: a ``copy_`` of the same bytes). With the default FUSED kernel the checkpoint
holds ``{"model": state_dict, "optim": fused_optimizer.state_dict()}``: the row-wise Adagrad
momentum is saved and loaded by every method. Each method then runs in its own rank
processes, so peak RSS growth (over the process's RSS before the model is built; the model
itself included, it is what every method ends with) belongs to that method alone. Page cache
warm by default; ``--cold`` evicts the checkpoint's pages before every repetition
(``metamat._pagecache.evict``: fsync + ``posix_fadvise(DONTNEED)``, checked with mincore;
never ``/proc/sys/vm/drop_caches``, which would empty a shared machine's whole cache).

``--cold`` adds a second table, measured in one set of rank processes with every
configuration interleaved in shuffled rounds (a shared machine drifts): the raw sequential-read
ceiling of the same checkpoint files (rank 0 alone: plain ``O_DIRECT`` preads of whole files
in 8 and 32 MiB requests, 1/2/4/8 threads taking the next request, no metamat code) against
``metamat.materialize(io="buffered"|"direct"|"auto", io_threads=1|2|4|8)`` on every rank
(auto: what a default load does; on a cold checkpoint, buffered with readahead, dropped
behind). GB/s there
is the checkpoint bytes all ranks read over the slowest rank's time (the read phase, and the
whole materialize); "x ceil" is that over the best raw row.
"""
from __future__ import annotations

import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _common import Row, finish, print_table, progress, raw_direct  # noqa: E402
from _quiet import quiet  # noqa: E402
from bench_dmp import _rss_gib, build_plan, sharder, table_configs  # noqa: E402

from metamat._pagecache import evict  # noqa: E402

REQUESTS = (8 << 20, 32 << 20)  # raw ceiling request sizes
IO_THREADS = (1, 2, 4, 8)
# after evicting: freeing GBs of page cache has after-effects here; the wait is 0.5 s for the
# default run's GBs, less for a smaller checkpoint's (--quick: ~0.03 s)
SETTLE_S_PER_GIB, SETTLE_MAX_S = 0.25, 0.5


def settle(ev) -> None:
    """Let the machine settle after the eviction ``ev``, in proportion to the bytes it freed."""
    freed = ev.nbytes * (ev.before if 0 <= ev.before <= 1 else 1)
    time.sleep(min(SETTLE_MAX_S, SETTLE_S_PER_GIB * freed / 2**30))


def _eager(world: int, cfgs, kernel: str):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    shd = sharder(kernel)
    return DistributedModelParallel(ebc, env=env, device=torch.device("cpu"),
                                    plan=build_plan(ebc, world, kernel, shd), sharders=[shd])


def _on_meta(world: int, cfgs, kernel: str):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import metamat

    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    shd = sharder(kernel)
    return metamat.shard_on_meta(ebc, plan=build_plan(ebc, world, kernel, shd), sharders=[shd])


def _dcp_state(model, kernel: str) -> dict:
    """What the checkpoint holds: the model, and with FUSED the fused optimizer's state."""
    if kernel == "fused":
        return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    return model.state_dict()


def _local_shards(model, kernel: str):
    """Every local tensor of the checkpointed state (the live storage: copy_ into it loads)."""
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif hasattr(v, "local_shards"):
            for i, s in enumerate(v.local_shards()):
                out[f"{prefix}#{i}"] = s.tensor
        elif isinstance(v, torch.Tensor):
            out[prefix] = v

    walk("", _dcp_state(model, kernel))
    return out


def _dcp_load(model, ckpt: str, kernel: str) -> None:
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(model, kernel)
    dcp.load(state, checkpoint_id=ckpt)
    if kernel == "fused":
        model.fused_optimizer.load_state_dict(state["optim"])


def _save(rank: int, world: int, per_rank: int, n_tables: int, dim: int, dtype_name: str,
          threads: int, root: str, reps: int, kernel: str):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    quiet()
    torch.set_num_threads(threads)
    cfgs = table_configs(per_rank, n_tables, dim, world, getattr(torch, dtype_name))
    model = _eager(world, cfgs, kernel)
    dcp.save(_dcp_state(model, kernel), checkpoint_id=os.path.join(root, "dcp"))
    local = _local_shards(model, kernel)
    torch.save(local, os.path.join(root, f"rank{rank}.pt"))
    nbytes = sum(t.numel() * t.element_size() for t in local.values())
    # memcpy ceiling: copy_ of the same bytes between two resident buffers
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    times, fresh = [], []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    del dst
    for _ in range(reps + 1):  # the same copy into fresh pages: what any load into new memory pays
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        torch.empty_like(src).copy_(src)
        fresh.append(time.perf_counter() - t0)
    return {"bytes": nbytes, "memcpy_s": statistics.median(times[1:]),
            "fresh_s": statistics.median(fresh[1:])}


def _rank(rank: int, world: int, method: str, per_rank: int, n_tables: int, dim: int,
          reps: int, dtype_name: str, threads: int, root: str, cold: bool, kernel: str):
    import resource

    import torch.distributed as dist

    import metamat

    quiet()
    torch.set_num_threads(threads)
    cfgs = table_configs(per_rank, n_tables, dim, world, getattr(torch, dtype_name))
    start_rss = _rss_gib()
    ckpt = os.path.join(root, "dcp")
    mine = os.path.join(root, f"rank{rank}.pt")
    model = _eager(world, cfgs, kernel) if method in ("dcp_only", "torch_load") else None
    times, amp, how, nbytes, reads = [], float("nan"), "warm", 0, []
    for _ in range(reps):
        if cold and rank == 0:
            ev = evict([ckpt] + [os.path.join(root, f"rank{r}.pt") for r in range(world)])
            how = f"fadvise, resident {ev.before:.2f}->{ev.after:.2f}"
            settle(ev)
        dist.barrier()
        t0 = time.perf_counter()
        if method == "dcp":
            model = None
            gc.collect()  # DMP holds reference cycles: free the previous rep's model first
            t0 = time.perf_counter()
            model = _eager(world, cfgs, kernel)
            _dcp_load(model, ckpt, kernel)
        elif method == "dcp_only":
            _dcp_load(model, ckpt, kernel)
        elif method == "torch_load":
            saved = torch.load(mine, mmap=True, weights_only=True)
            dst = _local_shards(model, kernel)
            with torch.no_grad():
                for k, t in saved.items():
                    dst[k].copy_(t)
            del saved
        else:
            model = None
            gc.collect()  # DMP holds reference cycles: free the previous rep's model first
            t0 = time.perf_counter()
            model = _on_meta(world, cfgs, kernel)
            rep = metamat.materialize(model, ckpt, device="cpu", progress=False,
                                      verify=method == "metamat_verify")
            amp, nbytes = rep.read_amplification, rep.bytes_needed
            reads.append(rep.seconds["read"])
        times.append(time.perf_counter() - t0)
    if not method.startswith("metamat"):
        nbytes = sum(t.numel() * t.element_size() for t in _local_shards(model, kernel).values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"median_s": statistics.median(times), "peak_rss_growth": peak - start_rss,
            "bytes": nbytes, "amp": amp, "cache": how,
            "read_s": statistics.median(reads) if reads else float("nan")}


def cold_rounds(configs, reps: int, seed: int, rank: int, ckpt: str, evictions: list):
    """Each of ``configs`` ``reps`` times, in shuffled rounds (the same order on every rank),
    each after rank 0 evicted the checkpoint from the page cache (appended to ``evictions``)
    and the disk settled; the ranks leave together. Drop the previous model before asking for
    the next config: it goes before eviction and timing."""
    import torch.distributed as dist

    order = list(configs)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for c in order:
            gc.collect()
            if rank == 0:
                evictions.append(evict(ckpt))
                settle(evictions[-1])
            dist.barrier()
            yield c


def time_raw(rank: int, files: List[str], threads: int, request: int):
    """The disk's ceiling: rank 0 reads ``files`` with O_DIRECT (:func:`raw_direct`) while the
    others wait; (seconds, bytes) on rank 0, None elsewhere."""
    import torch.distributed as dist

    r = None
    if rank == 0:
        t0 = time.perf_counter()
        n = raw_direct(files, threads, request)
        r = (time.perf_counter() - t0, n)
    dist.barrier()
    return r


def cold_configs():
    return ([("raw", t, req) for req in REQUESTS for t in IO_THREADS] +
            [(io, t, 0) for io in ("buffered", "direct", "auto") for t in IO_THREADS])


def _cold_rank(rank: int, world: int, per_rank: int, n_tables: int, dim: int, reps: int,
               dtype_name: str, threads: int, root: str, kernel: str):
    """Every cold configuration, interleaved in shuffled rounds; per config and round:
    (seconds, read-phase seconds, bytes read) of this rank, and rank 0's eviction check."""
    import metamat

    quiet()
    torch.set_num_threads(threads)
    cfgs = table_configs(per_rank, n_tables, dim, world, getattr(torch, dtype_name))
    ckpt = os.path.join(root, "dcp")
    files = [os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt)) if n.endswith(".distcp")]
    configs = cold_configs()
    out = {c: [] for c in configs}
    evictions = []
    for c in cold_rounds(configs, reps, 0, rank, ckpt, evictions):
        io, t, req = c
        if io == "raw":
            r = time_raw(rank, files, t, req)
            if r is not None:
                out[c].append((r[0], r[0], r[1], r[1]))
            continue
        t0 = time.perf_counter()
        model = _on_meta(world, cfgs, kernel)
        rep = metamat.materialize(model, ckpt, device="cpu", progress=False, io=io,
                                  io_threads=t)
        sec = time.perf_counter() - t0
        out[c].append((sec, rep.seconds["read"], rep.bytes_read, rep.bytes_direct))
        model = rep = None
    ev = {"before": [e.before for e in evictions], "after": [e.after for e in evictions],
          "files": evictions[0].files if evictions else 0}
    return {"out": out, "evict": ev if rank == 0 else None}


def run_cold(a, root: str, threads: int, kernel: str) -> List[Row]:
    """The cold read table: raw ceiling vs metamat buffered/direct at 1/2/4/8 reader threads."""
    from _dist import run_dist

    progress(f"load --cold: raw O_DIRECT ceiling and metamat buffered/direct x "
             f"{len(IO_THREADS)} thread counts, {a.reps} interleaved rounds")
    res = run_dist(_cold_rank, a.ranks, int(a.size_gib * 2**30), a.tables, a.dim, a.reps,
                   a.dtype, threads, root, kernel)
    ev = res[0]["evict"]
    rows = []
    for c in cold_configs():
        io, t, req = c
        per_rep = list(zip(*[r["out"][c] for r in res if r["out"][c]]))  # reps x ranks
        tot = statistics.median(max(x[0] for x in rr) for rr in per_rep)
        rd = statistics.median(max(x[1] for x in rr) for rr in per_rep)
        nbytes = statistics.median(sum(x[2] for x in rr) for rr in per_rep)
        direct = statistics.median(sum(x[3] for x in rr) for rr in per_rep)
        if io == "raw":
            label = f"raw O_DIRECT {t} thr x {req >> 20} MiB"
            extra = "rank 0 alone, whole .distcp files"
        else:
            label = f"metamat io={io} {t} thr/rank"
            extra = (f"{a.ranks} ranks; total (incl. shard_on_meta+alloc) "
                     f"{nbytes / tot / 1e9:.2f} GB/s; direct {direct / max(nbytes, 1):.0%}")
        rows.append(Row("load_cold", label, int(nbytes), rd, a.reps, extra=extra))
    for r in rows:
        r.gbps = r.nbytes / r.seconds / 1e9
    ceil = max(r.gbps for r in rows if r.method.startswith("raw"))
    for r in rows:
        r.pct_of_ceiling = 100 * r.gbps / ceil
        r.ratio_to_baseline = r.gbps / ceil
    rows[0].extra += (f"; eviction: {ev['files']} files, mincore residency before "
                      f"{min(ev['before']):.2f}-{max(ev['before']):.2f}, after "
                      f"{min(ev['after']):.3f}-{max(ev['after']):.3f}")
    return rows


def print_cold(rows: List[Row]) -> None:
    raw = [r for r in rows if r.method.startswith("raw")]
    ceil_row = max(raw, key=lambda r: r.gbps)
    ceil = ceil_row.gbps
    for t in IO_THREADS:
        b = next(r for r in rows if r.method == f"metamat io=buffered {t} thr/rank")
        for io in ("direct", "auto"):
            d = next(r for r in rows if r.method == f"metamat io={io} {t} thr/rank")
            d.extra += f"; {d.gbps / b.gbps:.2f}x buffered"
    print("\n== load, cold page cache: checkpoint evicted before every run (fsync + "
          "posix_fadvise(DONTNEED), checked with mincore: see the first row)")
    print(f"   GB/s = checkpoint bytes read by all ranks / slowest rank's read phase; "
          f"x ceil = GB/s over the best raw row ({ceil_row.method}, {ceil:.2f} GB/s)")
    print(f"{'method':<34}{'GB':>7}{'read s':>9}{'GB/s':>8}{'x ceil':>8}  extra")
    for r in rows:
        print(f"{r.method:<34}{r.nbytes / 1e9:>7.2f}{r.seconds:>9.3f}{r.gbps:>8.2f}"
              f"{r.ratio_to_baseline:>8.2f}  {r.extra}")
    best = max((r for r in rows if r.method.startswith("metamat io=direct")), key=lambda r: r.gbps)
    bestb = max((r for r in rows if r.method.startswith("metamat io=buffered")),
                key=lambda r: r.gbps)
    print(f"best direct: {best.method} {best.gbps:.2f} GB/s = {best.ratio_to_baseline:.2f}x "
          f"ceiling (goal >= 0.85x), {best.gbps / bestb.gbps:.2f}x best buffered "
          f"({bestb.method}, {bestb.gbps:.2f} GB/s)")
    dflt = min(8, os.cpu_count() or 1)
    auto = next((r for r in rows if r.method == f"metamat io=auto {dflt} thr/rank"), None)
    if auto is not None:
        print(f"default (io=auto, {dflt} thr/rank): {auto.gbps:.2f} GB/s = "
              f"{auto.ratio_to_baseline:.2f}x ceiling (goal >= 0.85x)")


def run_load(a, device: torch.device) -> List[Row]:
    from _dist import run_dist

    if device.type != "cpu":
        print("load mode: TorchRec tables load on CPU here (fbgemm-gpu-cpu); measuring CPU")
    per_rank = int(a.size_gib * 2**30)
    threads = max(1, (os.cpu_count() or 2) // a.ranks)
    root = tempfile.mkdtemp(prefix="metamat-bench-load-", dir=getattr(a, "tmp", None))
    cold = bool(getattr(a, "cold", False))
    kernel = getattr(a, "kernel", "fused")
    try:
        progress(f"load: writing the checkpoint ({kernel} kernel) with an eager DMP")
        saved = run_dist(_save, a.ranks, per_rank, a.tables, a.dim, a.dtype, threads, root, a.reps,
                         kernel)
        from metamat.checkpoint.checksum import write_manifest
        write_manifest(os.path.join(root, "dcp"))  # once, untimed: the verify row uses it
        nbytes = max(r["bytes"] for r in saved)
        memcpy_s = max(r["memcpy_s"] for r in saved)
        rows = [Row("load", "memcpy (copy_ of the same bytes)", nbytes, memcpy_s, a.reps,
                    peak_rss_gib=2 * nbytes / 2**30, extra="ceiling; RSS = src + dst buffers"),
                Row("load", "memcpy into fresh pages", nbytes, max(r["fresh_s"] for r in saved),
                    a.reps, peak_rss_gib=2 * nbytes / 2**30,
                    extra="ceiling for loads into new memory (page faults included)")]
        labels = (("dcp", "TorchRec eager DMP + dcp.load"),
                  ("dcp_only", "dcp.load only (into eager DMP)"),
                  ("torch_load", "torch.load(mmap)+copy_ (per rank)"),
                  ("metamat", "metamat shard_on_meta+materialize"),
                  ("metamat_verify", "metamat materialize verify=True"))
        for method, label in labels:
            progress(f"load: {label}, {a.reps} reps, {'cold' if cold else 'warm'} cache")
            res = run_dist(_rank, a.ranks, method, per_rank, a.tables, a.dim, a.reps, a.dtype,
                           threads, root, cold, kernel)
            extra = f"{a.ranks} ranks, {'cold: ' + res[0]['cache'] if cold else 'warm'} cache"
            if method.startswith("metamat"):
                extra += f", read amplification {max(r['amp'] for r in res):.3f}"
            if method == "metamat":
                plain, plain_read = (max(r["median_s"] for r in res),
                                     max(r["read_s"] for r in res))
            if method == "metamat_verify":  # runs after "metamat"
                t, t_read = max(r["median_s"] for r in res), max(r["read_s"] for r in res)
                extra += (f", verify overhead {t / plain - 1:+.1%} total, "
                          f"{t_read / plain_read - 1:+.1%} read phase")
            rows.append(Row("load", label, max(r["bytes"] for r in res),
                            max(r["median_s"] for r in res), a.reps,
                            peak_rss_gib=max(r["peak_rss_growth"] for r in res), extra=extra))
        base, ceil = "TorchRec eager DMP + dcp.load", "memcpy (copy_ of the same bytes)"
        finish(rows, base, ceil)
        cold_rows = run_cold(a, root, threads, kernel) if cold else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(f"load: {a.tables} tables, dim {a.dim}, {kernel} kernel"
                f"{' + row-wise Adagrad state' if kernel == 'fused' else ''}, ~{a.size_gib:g} "
                f"GiB/rank, {a.ranks} ranks, {threads} thread(s)/rank; per-rank bytes, slowest "
                f"rank", rows, base, ceil)
    if cold_rows:
        print_cold(cold_rows)
    return rows + cold_rows
