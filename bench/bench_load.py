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
memcpy ceiling: a ``copy_`` of the same bytes). Each method then runs in its own rank
processes, so peak RSS growth (over the process's RSS before the model is built; the model
itself included, it is what every method ends with) belongs to that method alone. Page cache
warm by default; ``--cold`` drops it before every repetition (``/proc/sys/vm/drop_caches`` if
permitted, else ``posix_fadvise(DONTNEED)`` on every checkpoint file).
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

from _common import Row, finish, print_table  # noqa: E402
from bench_dmp import _rss_gib, build_plan, table_configs  # noqa: E402


def drop_cache(paths: List[str]) -> str:
    """Evict ``paths`` (files or directories) from the page cache; returns how."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(d, n) for d, _, ns in os.walk(p) for n in ns]
        for fn in files:
            fd = os.open(fn, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _eager(world: int, cfgs):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return DistributedModelParallel(ebc, env=env, device=torch.device("cpu"),
                                    plan=build_plan(ebc, world))


def _local_shards(model):
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "local_shards"):
            for i, s in enumerate(v.local_shards()):
                out[f"{k}#{i}"] = s.tensor
        else:
            out[k] = v
    return out


def _save(rank: int, world: int, per_rank: int, n_tables: int, dim: int, dtype_name: str,
          threads: int, root: str, reps: int):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(threads)
    cfgs = table_configs(per_rank, n_tables, dim, world, getattr(torch, dtype_name))
    model = _eager(world, cfgs)
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, "dcp"))
    local = _local_shards(model)
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
          reps: int, dtype_name: str, threads: int, root: str, cold: bool):
    import resource

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import metamat

    torch.set_num_threads(threads)
    cfgs = table_configs(per_rank, n_tables, dim, world, getattr(torch, dtype_name))
    start_rss = _rss_gib()
    ckpt = os.path.join(root, "dcp")
    mine = os.path.join(root, f"rank{rank}.pt")
    model = _eager(world, cfgs) if method in ("dcp_only", "torch_load") else None
    times, amp, how, nbytes, reads = [], float("nan"), "warm", 0, []
    for _ in range(reps):
        if cold and rank == 0:
            how = drop_cache([ckpt] + [os.path.join(root, f"rank{r}.pt") for r in range(world)])
        dist.barrier()
        t0 = time.perf_counter()
        if method == "dcp":
            model = None
            gc.collect()  # DMP holds reference cycles: free the previous rep's model first
            t0 = time.perf_counter()
            model = _eager(world, cfgs)
            dcp.load(model.state_dict(), checkpoint_id=ckpt)
        elif method == "dcp_only":
            dcp.load(model.state_dict(), checkpoint_id=ckpt)
        elif method == "torch_load":
            saved = torch.load(mine, mmap=True, weights_only=True)
            dst = _local_shards(model)
            with torch.no_grad():
                for k, t in saved.items():
                    dst[k].copy_(t)
            del saved
        else:
            model = None
            gc.collect()  # DMP holds reference cycles: free the previous rep's model first
            t0 = time.perf_counter()
            ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
            model = metamat.shard_on_meta(ebc, plan=build_plan(ebc, world))
            rep = metamat.materialize(model, ckpt, device="cpu", progress=False,
                                      verify=method == "metamat_verify")
            amp, nbytes = rep.read_amplification, rep.bytes_needed
            reads.append(rep.seconds["read"])
        times.append(time.perf_counter() - t0)
    if not method.startswith("metamat"):
        nbytes = sum(t.numel() * t.element_size() for t in _local_shards(model).values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"median_s": statistics.median(times), "peak_rss_growth": peak - start_rss,
            "bytes": nbytes, "amp": amp, "cache": how,
            "read_s": statistics.median(reads) if reads else float("nan")}


def run_load(a, device: torch.device) -> List[Row]:
    from _dist import run_dist

    if device.type != "cpu":
        print("load mode: TorchRec tables load on CPU here (fbgemm-gpu-cpu); measuring CPU")
    per_rank = int(a.size_gib * 2**30)
    threads = max(1, (os.cpu_count() or 2) // a.ranks)
    root = tempfile.mkdtemp(prefix="metamat-bench-load-", dir=getattr(a, "tmp", None))
    cold = bool(getattr(a, "cold", False))
    try:
        saved = run_dist(_save, a.ranks, per_rank, a.tables, a.dim, a.dtype, threads, root, a.reps)
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
            print(f"load: running {label} ...", file=sys.stderr, flush=True)
            res = run_dist(_rank, a.ranks, method, per_rank, a.tables, a.dim, a.reps, a.dtype,
                           threads, root, cold)
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
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base, ceil = "TorchRec eager DMP + dcp.load", "memcpy (copy_ of the same bytes)"
    finish(rows, base, ceil)
    print_table(f"load: {a.tables} tables, dim {a.dim}, ~{a.size_gib:g} GiB/rank, {a.ranks} ranks, "
                f"{threads} thread(s)/rank; per-rank bytes, slowest rank", rows, base, ceil)
    return rows
