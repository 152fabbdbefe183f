"""A cut-down ``--mode load --cold`` (bench_load.py's cold table) for iterating on the reader.

Writes the bench_load checkpoint once (``--root DIR`` keeps it between runs), then measures
only the configurations asked for, interleaved in shuffled rounds in one set of rank
processes, each run after evicting the checkpoint (``metamat._pagecache.evict``)::

    .venv/bin/python bench/bench_cold.py --root /tmp/cold-ckpt --size-gib 1 --reps 3 \\
        raw:1:32 raw:2:8 buffered:2 direct:2 auto:2 direct:2:METAMAT_IO_OVERLAP=0

A config is ``raw:<threads>:<MiB>`` (plain O_DIRECT whole-file reads, rank 0 alone: the
ceiling) or ``<io>:<threads>[:VAR=VAL,...]`` (``metamat.materialize(io=, io_threads=)`` on
every rank with those environment variables set for the call; the reader reads them per
call). GB/s = checkpoint bytes read by all ranks / the slowest rank's read phase; the load
average is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from bench_load import _on_meta, _save, cold_rounds, time_raw  # noqa: E402


def parse(cfg: str):
    parts = cfg.split(":")
    if parts[0] == "raw":
        return ("raw", int(parts[1]), int(parts[2]) << 20, ())
    env = tuple(tuple(kv.split("=", 1)) for kv in parts[2].split(",")) if len(parts) > 2 else ()
    return (parts[0], int(parts[1]), 0, env)


def _rank(rank, world, per_rank, n_tables, dim, reps, root, kernel, configs, seed):
    import torch

    import metamat
    from _quiet import quiet
    from bench_dmp import table_configs

    quiet()
    torch.set_num_threads(1)
    cfgs = table_configs(per_rank, n_tables, dim, world, torch.float32)
    ckpt = os.path.join(root, "dcp")
    files = [os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt)) if n.endswith(".distcp")]
    out = {c: [] for c in configs}
    evictions = []
    for c in cold_rounds(configs, reps, seed, rank, ckpt, evictions):
        io, t, req, env = parse(c)
        if io == "raw":
            r = time_raw(rank, files, t, req)
            if r is not None:
                out[c].append(r)
            continue
        old = {k: os.environ.get(k) for k, _ in env}
        os.environ.update(dict(env))
        try:
            model = _on_meta(world, cfgs, kernel)
            rep = metamat.materialize(model, ckpt, device="cpu", progress=False, io=io,
                                      io_threads=t)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out[c].append((rep.seconds["read"], rep.bytes_read, rep.bytes_direct))
        model = rep = None
    return {"out": out, "after": [e.after for e in evictions]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+")
    p.add_argument("--root", default="/tmp/metamat-bench-cold")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--tables", type=int, default=5)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", default="fused")
    a = p.parse_args()
    from _dist import run_dist

    per_rank = int(a.size_gib * 2**30)
    stamp = os.path.join(a.root, f"done-{a.size_gib:g}-{a.tables}-{a.dim}-{a.ranks}-{a.kernel}")
    if not os.path.exists(stamp):
        import shutil
        shutil.rmtree(a.root, ignore_errors=True)
        os.makedirs(a.root)
        run_dist(_save, a.ranks, per_rank, a.tables, a.dim, "float32", 1, a.root, 1, a.kernel)
        for r in range(a.ranks):  # only the DCP files are read here
            os.remove(os.path.join(a.root, f"rank{r}.pt"))
        open(stamp, "w").close()
    la0 = os.getloadavg()
    t0 = time.time()
    res = run_dist(_rank, a.ranks, per_rank, a.tables, a.dim, a.reps, a.root, a.kernel,
                   list(a.configs), a.seed)
    la1 = os.getloadavg()
    after = res[0]["after"]
    print(f"load average before {la0[0]:.2f} {la0[1]:.2f} {la0[2]:.2f}, after "
          f"{la1[0]:.2f} {la1[1]:.2f} {la1[2]:.2f}; {time.time() - t0:.0f} s; residency after "
          f"eviction {min(after):.3f}-{max(after):.3f}; {a.reps} rounds, medians")
    rows = []
    for c in a.configs:
        io = parse(c)[0]
        if io == "raw":
            xs = res[0]["out"][c]
            s = statistics.median(x[0] for x in xs)
            n = xs[0][1]
            rows.append((c, n, s, n / s / 1e9, sorted(x[1] / x[0] / 1e9 for x in xs), ""))
            continue
        per_rep = list(zip(*[r["out"][c] for r in res]))
        secs = [max(x[0] for x in rr) for rr in per_rep]
        n = sum(x[1] for x in per_rep[0])
        d = sum(x[2] for x in per_rep[0])
        s = statistics.median(secs)
        rows.append((c, n, s, n / s / 1e9, sorted(n / x / 1e9 for x in secs),
                     f"direct {d / max(n, 1):.0%}"))
    ceil = max(r[3] for r in rows if r[0].startswith("raw")) if any(
        r[0].startswith("raw") for r in rows) else float("nan")
    print(f"{'config':<44}{'GB':>6}{'read s':>8}{'GB/s':>7}{'x ceil':>7}  all GB/s")
    for c, n, s, g, allg, extra in rows:
        print(f"{c:<44}{n / 1e9:>6.2f}{s:>8.3f}{g:>7.2f}{g / ceil:>7.2f}  "
              f"{' '.join(f'{x:.2f}' for x in allg)}  {extra}")


if __name__ == "__main__":
    main()
