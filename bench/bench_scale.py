"""--mode scale: time against the count of things (issue 17), one process, world size 1.

Three sweeps, each with its baselines measured in the same run:

* ``tables``: N tiny tables (100 rows x 16 dims, table-wise, FUSED) -> shard_on_meta +
  materialize against TorchRec's eager ``DistributedModelParallel(device=cpu)``, both given
  the same EmbeddingBagCollection built on meta (its build is timed on its own and reported);
  the ``plan`` phase of materialize is reported on its own.
* ``rows`` / ``cols``: one tensor saved by DCP as N row (or column) chunks -> open_checkpoint
  and materialize-load against ``dcp.load`` and DCP's own ``read_metadata``.
* ``tensors``: N small tensors (16 floats) in one DCP checkpoint -> open + materialize-load
  against ``dcp.load`` into real tensors.
* ``modules``: N EmbeddingBagCollections of 10 tiny tables each (towers in a ModuleDict,
  table-wise) -> shard_on_meta + materialize against eager DMP: the per-module cost (one
  fbgemm TBE per module, with ~50 small metadata buffers of its own).
* ``ranks``: 20 row-wise tables (a shard per rank) sharded for a world of N ranks ->
  ``shard_on_meta`` against eager DMP, each in a child process on a ``fake`` process group of
  N ranks (rank 0's shards; the collectives do nothing). On a fake group TorchRec builds no
  module state (its ShardedTensors); the fused optimizer's is built, in both methods.

Prints seconds and microseconds per item against the count, writes ``scale.csv`` and a
log-log ``scale.png`` under ``--out``. ``METAMAT_SCALE_CLOCK=cpu`` measures this process's CPU
time instead of wall time (for a shared, overloaded machine, where wall time is mostly
waiting for a core; the tests use it).
"""
from __future__ import annotations

import csv
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# shared with the tests: metamat/testing.py, metamat/models/torchrec/testing.py
from metamat.testing import ManyTensors as _Many, OneTensor as _One  # noqa: E402
from metamat.testing import process_group, save_chunked, save_many  # noqa: E402,F401
from metamat.models.torchrec.testing import ebc as _ebc  # noqa: E402
from metamat.models.torchrec.testing import sharder_and_plan as _sharder_and_plan  # noqa: E402
from metamat.models.torchrec.testing import towers  # noqa: E402


TABLE_COUNTS = (10, 100, 1000, 10000)
CHUNK_COUNTS = (100, 1000, 10000, 100000)
QUICK_TABLE_COUNTS = (10, 100, 300)  # --quick: under a minute on an idle 2-core box
QUICK_CHUNK_COUNTS = (100, 1000, 3000)
MODULE_COUNTS = (10, 40, 160, 640)
QUICK_MODULE_COUNTS = (5, 20)
MODULE_TABLES = 10
RANK_COUNTS = (64, 256, 1024, 4096)
QUICK_RANK_COUNTS = (16, 64, 256)
RANK_TABLES = 20


def _towers(m: int, tables: int = MODULE_TABLES) -> nn.Module:
    return towers(m, tables)


def clock() -> float:
    """Wall time, or this process's CPU time with ``METAMAT_SCALE_CLOCK=cpu``."""
    if os.environ.get("METAMAT_SCALE_CLOCK") == "cpu":
        return time.process_time()
    return time.perf_counter()


def _median(fn: Callable[[], None], reps: int, setup: Optional[Callable[[], object]] = None):
    times = []
    for _ in range(reps):
        arg = setup() if setup else None
        gc.collect()
        t0 = clock()
        fn(arg) if setup else fn()
        times.append(clock() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# tables


def run_tables(counts: Sequence[int], reps: int, log=print) -> List[dict]:
    """Eager DMP vs shard_on_meta + materialize for each table count.

    The user's ``EmbeddingBagCollection`` on meta is the input of both and is built outside
    the timed calls (TorchRec's own per-table cost, the same for both methods); its build is
    timed on its own and reported beside them, with the ratio it gives when counted in both.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    out = []
    import torch.distributed as dist
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    for n in counts:
        sharder, plan = _sharder_and_plan(_ebc(n))
        r = max(1, reps if n <= 1000 else min(reps, 2))

        def eager(ebc):
            DistributedModelParallel(ebc, env=env, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])

        phases: Dict[str, List[float]] = {}

        def meta(ebc):
            dmp = metamat.shard_on_meta(ebc, env=env, plan=plan, sharders=[sharder])
            t0 = clock()
            rep = metamat.materialize(dmp, device="cpu")
            phases.setdefault("materialize", []).append(clock() - t0)
            for k, v in rep.seconds.items():
                phases.setdefault(k, []).append(v)

        t_ebc = _median(lambda: _ebc(n), r)
        t_eager = _median(eager, r, setup=lambda: _ebc(n))
        t_meta = _median(meta, r, setup=lambda: _ebc(n))
        ph = {k: statistics.median(v) for k, v in phases.items()}
        out.append(dict(case="tables", method="user's EBC on meta (input of both)", count=n,
                        seconds=t_ebc))
        out.append(dict(case="tables", method="torchrec-dmp (eager)", count=n, seconds=t_eager))
        out.append(dict(case="tables", method="metamat shard_on_meta+materialize", count=n,
                        seconds=t_meta))
        out.append(dict(case="tables", method="metamat materialize", count=n,
                        seconds=ph["materialize"]))
        out.append(dict(case="tables", method="metamat plan phase", count=n,
                        seconds=ph.get("plan", float("nan"))))
        log(f"tables {n:>7}: eager DMP {t_eager:8.3f} s  metamat {t_meta:8.3f} s "
            f"({t_meta / t_eager:.2f}x; {(t_meta + t_ebc) / (t_eager + t_ebc):.2f}x with the "
            f"EBC build {t_ebc:.3f} s in both)  materialize {ph['materialize']:.3f} s  plan "
            f"{ph.get('plan', float('nan')) * 1e6 / n:.1f} us/table")
    return out


def plan_parts(n: int, reps: int = 5) -> Dict[str, float]:
    """CPU µs per table of the plan's parts on one ``shard_on_meta`` model of ``n`` tables:
    the object-graph walk (``scan``) and the whole plan (``find_parts`` with the device given),
    each the minimum of ``reps`` calls with the collector paused, as ``materialize`` runs them.
    Minima, because this box's noise moves single calls by tens of percent; compare trees by
    alternating processes (``python bench/bench_scale.py plan 3000``)."""
    from torchrec.distributed.types import ShardingEnv
    import torch.distributed as dist

    import metamat
    from metamat.models import find_parts
    from metamat.models.torchrec.graph import scan

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder, plan = _sharder_and_plan(_ebc(n))
    dmp = metamat.shard_on_meta(_ebc(n), env=env, plan=plan, sharders=[sharder])
    cpu = torch.device("cpu")
    calls = {"scan": lambda: scan(dmp),
             "find_parts": lambda: find_parts(dmp, cpu, {}, loading=False)}
    out = {}
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for name, fn in calls.items():
            best = float("inf")
            for _ in range(reps):
                t0 = time.process_time()
                fn()
                best = min(best, time.process_time() - t0)
            out[name] = best * 1e6 / n
    finally:
        if was:
            gc.enable()
    return out


# ---------------------------------------------------------------------------------------------
# modules


def run_modules(counts: Sequence[int], reps: int, log=print) -> List[dict]:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    import torch.distributed as dist

    import metamat

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    out = []
    for n in counts:
        proto = _towers(n)
        plans = {}
        sharder = None
        for j in range(n):
            sharder, tower_plan = _sharder_and_plan(proto.towers[f"m{j}"])
            plans[f"towers.m{j}"] = tower_plan.plan[""]
        plan = ShardingPlan(plans)
        r = max(1, reps if n <= 40 else min(reps, 2))
        phases: Dict[str, List[float]] = {}

        def eager(model):
            DistributedModelParallel(model, env=env, device=torch.device("cpu"), plan=plan,
                                     sharders=[sharder])

        def meta(model):
            dmp = metamat.shard_on_meta(model, env=env, plan=plan, sharders=[sharder])
            rep = metamat.materialize(dmp, device="cpu")
            phases.setdefault("plan", []).append(rep.seconds["plan"])

        t_eager = _median(eager, r, setup=lambda: _towers(n))
        t_meta = _median(meta, r, setup=lambda: _towers(n))
        t_plan = statistics.median(phases["plan"])
        out += [dict(case="modules", method="torchrec-dmp (eager)", count=n, seconds=t_eager),
                dict(case="modules", method="metamat shard_on_meta+materialize", count=n,
                     seconds=t_meta),
                dict(case="modules", method="metamat plan phase", count=n, seconds=t_plan)]
        log(f"modules {n:>5} (x{MODULE_TABLES} tables): eager DMP {t_eager:8.3f} s  metamat "
            f"{t_meta:8.3f} s ({t_meta / t_eager:.2f}x)  plan {t_plan * 1e3 / n:.2f} ms/module")
    return out


# ---------------------------------------------------------------------------------------------
# ranks


def time_ranks(world: int, tables: int, method: str) -> float:
    """Seconds of ``method`` ("metamat" or "eager") sharding ``tables`` row-wise tables for a
    world of ``world`` ranks, as rank 0 of a fake process group. Run it in a process of its
    own (``python bench/bench_scale.py ranks WORLD TABLES METHOD``): it initialises the default
    group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import metamat

    rows = 4 * world  # every rank gets rows
    sharder, plan = _sharder_and_plan(_ebc(tables, rows=rows), world, row_wise=True)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    ebc = _ebc(tables, rows=rows)  # the input of the timed call, built outside it
    gc.collect()
    t0 = clock()
    if method == "metamat":
        metamat.shard_on_meta(ebc, env=env, plan=plan, sharders=[sharder])
    else:
        DistributedModelParallel(ebc, env=env, device=torch.device("cpu"), plan=plan,
                                 sharders=[sharder])
    return clock() - t0


def run_ranks(counts: Sequence[int], log=print) -> List[dict]:
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch.testing._internal.distributed.fake_pg") is None:
        log("ranks: skipped (this torch has no fake process group)")
        return []
    out = []
    for n in counts:
        got = {}
        for method, label in (("eager", "torchrec-dmp (eager)"),
                              ("metamat", "metamat shard_on_meta")):
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "ranks", str(n),
                                str(RANK_TABLES), method], capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"ranks {n} {method} failed:\n{r.stderr[-3000:]}")
            got[method] = float(r.stdout.split()[-1])
            out.append(dict(case="ranks", method=label, count=n, seconds=got[method]))
        log(f"ranks {n:>7} ({RANK_TABLES} row-wise tables): eager DMP {got['eager']:8.3f} s  "
            f"shard_on_meta {got['metamat']:8.3f} s ({got['metamat'] / got['eager']:.2f}x)")
    return out


# ---------------------------------------------------------------------------------------------
# chunks and tensors


def _dcp_metadata(path: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    FileSystemReader(path).read_metadata()


def _load_case(case: str, path: str, n: int, reps: int, make_model, make_sd, log) -> List[dict]:
    import torch.distributed.checkpoint as dcp

    import metamat

    r = max(1, reps if n <= 10000 else min(reps, 2))
    t_meta_read = _median(lambda: _dcp_metadata(path), r)
    t_dcp = _median(lambda sd: dcp.load(sd, checkpoint_id=path), r, setup=make_sd)
    t_open = _median(lambda: metamat.open_checkpoint(path), r)
    t_load = _median(lambda m: metamat.materialize(m, path, device="cpu"), r, setup=make_model)
    rows = [dict(case=case, method="dcp read_metadata", count=n, seconds=t_meta_read),
            dict(case=case, method="dcp.load", count=n, seconds=t_dcp),
            dict(case=case, method="metamat open_checkpoint", count=n, seconds=t_open),
            dict(case=case, method="metamat materialize(load)", count=n, seconds=t_load)]
    log(f"{case:<7} {n:>7}: dcp metadata {t_meta_read:7.3f} s  dcp.load {t_dcp:7.3f} s  "
        f"open {t_open:7.3f} s ({t_open * 1e6 / n:6.1f} us/item)  materialize {t_load:7.3f} s "
        f"({t_load / t_dcp:.2f}x dcp.load)")
    return rows


def run_chunks(counts: Sequence[int], reps: int, layout: str = "rows", log=print) -> List[dict]:
    out = []
    for n in counts:
        d = tempfile.mkdtemp(prefix="metamat-scale-")
        try:
            shape = save_chunked(d, n, layout)
            out += _load_case(layout, d, n, reps, lambda: _One(shape),
                              lambda: {"w": torch.empty(shape)}, log)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def run_tensors(counts: Sequence[int], reps: int, log=print) -> List[dict]:
    out = []
    for n in counts:
        d = tempfile.mkdtemp(prefix="metamat-scale-")
        try:
            save_many(d, n)
            out += _load_case("tensors", d, n, reps, lambda: _Many(n),
                              lambda: {f"p{i}": torch.empty(16) for i in range(n)}, log)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# growth (the tests' linearity check)


def _chunks_case(layout: str):
    def prepare(n, d):
        shape = save_chunked(d, n, layout)
        return lambda: _One(shape)
    return prepare


def _tensors_case(n, d):
    save_many(d, n)
    return lambda: _Many(n)


def measured_growth(case: str, counts: Sequence[int], rounds: int = 7) -> Dict[str, float]:
    """``per_item_growth`` of metamat's methods for ``case`` ("tables", "rows", "cols" or
    "tensors"), measured so that this box's drift does not read as super-linear growth.

    The sweeps above time each count in turn, so a slow minute that falls on the largest
    count reads as growth (cols, fresh-clone CI: 2.2 and 2.5 where the same tree measures
    1.0-1.5). Here every count is prepared first, then ``rounds`` rounds time each count once
    (alternating the order), and each count keeps its fastest call: drift lands on all
    counts alike, and one interrupted call is dropped."""
    import metamat

    best: Dict[tuple, float] = {}

    def keep(method, n, seconds):
        best[method, n] = min(best.get((method, n), float("inf")), seconds)

    def timed(fn, arg):
        gc.collect()
        t0 = clock()
        out = fn(arg)
        return clock() - t0, out

    dirs: Dict[int, str] = {}  # checkpoint directory of each count (chunks and tensors)
    if case == "tables":
        from torchrec.distributed.types import ShardingEnv
        import torch.distributed as dist

        env = ShardingEnv.from_process_group(dist.group.WORLD)
        plans = {n: _sharder_and_plan(_ebc(n)) for n in counts}

        def meta(n_ebc):
            sharder, plan = plans[n_ebc[0]]
            dmp = metamat.shard_on_meta(n_ebc[1], env=env, plan=plan, sharders=[sharder])
            return metamat.materialize(dmp, device="cpu")

        def measure(n):
            # the user's EBC on meta is built outside the timed call, as in run_tables
            t, rep = timed(meta, (n, _ebc(n)))
            keep("metamat shard_on_meta+materialize", n, t)
            keep("metamat plan phase", n, rep.seconds["plan"])
    else:
        prepare = _tensors_case if case == "tensors" else _chunks_case(case)
        models = {}

        def measure(n):
            keep("metamat open_checkpoint", n, timed(metamat.open_checkpoint, dirs[n])[0])
            keep("metamat materialize(load)", n,
                 timed(lambda m: metamat.materialize(m, dirs[n], device="cpu"),
                       models[n]())[0])
    try:
        if case != "tables":
            for n in counts:
                dirs[n] = tempfile.mkdtemp(prefix="metamat-growth-")
                models[n] = prepare(n, dirs[n])
        for r in range(rounds):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                measure(n)
    finally:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    results = [dict(case=case, method=m, count=n, seconds=s) for (m, n), s in best.items()]
    return {m: per_item_growth(results, case, m) for m in sorted({m for m, _ in best})}


# ---------------------------------------------------------------------------------------------
# report


def write_scale_csv(path: str, results: List[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["case", "method", "count", "seconds", "us_per_item"])
        w.writeheader()
        for r in results:
            w.writerow(dict(r, us_per_item=r["seconds"] * 1e6 / r["count"]))


def plot_scale(results: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in results})
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        lines: Dict[str, list] = {}
        for r in results:
            if r["case"] == case:
                lines.setdefault(r["method"], []).append((r["count"], r["seconds"]))
        for m, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts],
                    "-o" if m.startswith("metamat") else "--s", label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"count ({case})")
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_item_growth(results: List[dict], case: str, method: str) -> float:
    """Marginal time per item between the two largest counts over the marginal time per item
    between the smallest and the second largest (differences remove the fixed overhead).
    1.0 is linear; inf when the smaller counts' marginal time was not positive (timing noise
    at small counts: measure with more rounds)."""
    pts = sorted((r["count"], r["seconds"]) for r in results
                 if r["case"] == case and r["method"] == method)
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    if len(pts) < 3:
        return 1.0
    nm, tm = pts[-2]
    first = (tm - t0) / (nm - n0)
    last = (t1 - tm) / (n1 - nm)
    return last / first if first > 0 else float("inf")


def run_scale(a, device=None, log=print) -> list:
    """The --mode scale entry point of bench/materialize.py."""
    tc = QUICK_TABLE_COUNTS if a.quick else TABLE_COUNTS
    cc = QUICK_CHUNK_COUNTS if a.quick else CHUNK_COUNTS
    rc = QUICK_RANK_COUNTS if a.quick else RANK_COUNTS
    mc = QUICK_MODULE_COUNTS if a.quick else MODULE_COUNTS
    reps = 1 if a.quick else max(1, a.reps)
    results: List[dict] = []
    log("\n== scale: seconds against the count (one process, world size 1; "
        f"{'CPU' if os.environ.get('METAMAT_SCALE_CLOCK') == 'cpu' else 'wall'} time)")
    with process_group():
        results += run_tables(tc, reps, log=log)
        results += run_chunks(cc, reps, "rows", log=log)
        results += run_chunks(cc[:-1] if not a.quick else cc, reps, "cols", log=log)
        results += run_tensors(cc, reps, log=log)
        results += run_modules(mc, reps, log=log)
    results += run_ranks(rc, log=log)  # child processes, each with its own (fake) group
    if a.out:
        write_scale_csv(os.path.join(a.out, "scale.csv"), results)
        try:
            plot_scale(results, os.path.join(a.out, "scale.png"))
            log(f"wrote {os.path.join(a.out, 'scale.csv')} and scale.png")
        except ImportError as e:
            log(f"wrote {os.path.join(a.out, 'scale.csv')} (no plot: {e})")
    # scale.csv / scale.png above are this mode's results; the GB/s rows and plot of the
    # other modes do not fit counts, so nothing is returned to them.
    return []


if __name__ == "__main__":  # python bench/bench_scale.py plan N [REPS] | ranks W N METHOD
    if len(sys.argv) == 5 and sys.argv[1] == "ranks":
        print(time_ranks(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
        sys.exit(0)
    if len(sys.argv) < 3 or sys.argv[1] != "plan":
        sys.exit("usage: bench_scale.py plan TABLES [REPS] | ranks WORLD TABLES METHOD")
    with process_group():
        r = plan_parts(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 5)
    print(f"{sys.argv[2]} tables, CPU time per table (min of calls): "
          + "  ".join(f"{k} {v:.1f} us" for k, v in r.items()))
