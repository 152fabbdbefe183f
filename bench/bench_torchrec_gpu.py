"""--mode dmp / --mode load with --device cuda: TorchRec tables on the GPU, one rank (a gloo
group of one in this process), every method and ceiling in the same run.

dmp (init), three table sets:

* large DEVICE tables (``--tables`` of ``--dim``, ``--size-gib`` in all, kernel ``fused``,
  row-wise Adagrad state): eager ``DistributedModelParallel(device=cuda)`` (TorchRec's own init:
  fbgemm's zeros, the kernel's uniform_, then each table's init_fn) against
  ``shard_on_meta(compute_device="cuda")`` + ``materialize``, and against ``fill_`` of the same
  device bytes (the HBM write ceiling);
* UVM tables (``fused_uvm``, at most ``UVM_GIB_MAX`` GiB: the host writes them at host-memory
  speed): metamat writes unified memory from the host, so its ceilings are ``fill_`` of fresh
  unified memory of the same kind from the host (fbgemm's allocator) and of fresh pageable
  host memory, with every CPU thread;
* many small DEVICE tables (``--small-tables`` of 1,000 x 64): TorchRec's per-table work
  against metamat's.

The user's ``EmbeddingBagCollection`` on meta and the plan are built before each timed call
(their common input, as in ``--mode scale``). Rows per set: eager DMP, metamat
(``shard_on_meta`` + ``materialize``), ``materialize`` alone, metamat's fill phase (the bytes
it wrote over the phase's seconds, the GPU synchronised), and the ceilings. A table set's rows
go to ``--out``'s results.csv as soon as it is measured (a stopped run keeps them).

load: a DCP checkpoint (tables + optimizer state) of the large DEVICE tables, page cache warm:
eager DMP(device=cuda) + ``dcp.load`` (building the eager model included, as a user pays it)
against ``shard_on_meta`` + ``materialize(model, ckpt)``, and two ceilings of the same bytes:
reading the checkpoint's files from the page cache into pinned memory with metamat's number of
reader threads (8 MiB preads, best of the reps), and the pinned host-to-device copy.

``--emulate``: the same code on the emulated device (:mod:`metamat.emulation`) with CPU
stand-ins for the baselines and ceilings: a smoke test of this bench for machines without a
GPU (its numbers say nothing about a GPU).
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import threading
import statistics
import time
from typing import Callable, List, Optional

import torch

from _common import Row, finish, print_table, progress, times, write_csv

SMALL_ROWS, SMALL_DIM = 1000, 64
UVM_GIB_MAX = 4.0  # the UVM set's bytes at most: host memory is written at ~10 GB/s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], object], reps: int, device: torch.device,
           setup: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of ``reps`` calls after one warm-up. What ``fn`` returns is kept until
    the next call's untimed set-up frees it (models do not accumulate in GPU memory, and no
    call pays for freeing the last one's); ``setup`` runs untimed before each call."""
    held: list = []

    def before():
        held.clear()
        _free(device)
        if setup:
            setup()

    t = statistics.median(times(lambda: held.append(fn()), reps, device, setup=before))
    held.clear()
    _free(device)
    return t


def _tables(n: int, rows: int, dim: int, prefix: str = "t"):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=f"{prefix}{i}", embedding_dim=dim, num_embeddings=rows,
                               feature_names=[f"f{i}"]) for i in range(n)]


def _sharder():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})


def _plan(ebc, kernel: str, device_type: str, shd):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan

    mp = construct_module_sharding_plan(
        ebc, {c.name: table_wise(rank=0) for c in ebc.embedding_bag_configs()}, local_size=1,
        world_size=1, device_type=device_type, sharder=shd)
    for ps in mp.values():
        ps.compute_kernel = kernel
    return ShardingPlan({"": mp})


class _Methods:
    """Build the same tables with TorchRec (eager) or metamat, on the device or emulated.
    ``prepare`` makes the common input (the EBC on meta, the plan, the sharder) untimed; the
    timed calls take it. ``reports`` keeps every metamat call's (Report, seconds of
    materialize)."""

    def __init__(self, device: torch.device, emulate: bool):
        self.device, self.emulate = device, emulate
        self.reports: list = []
        self.inputs: Optional[tuple] = None

    def prepare(self, cfgs, kernel: str, eager: bool) -> None:
        from torchrec import EmbeddingBagCollection

        if eager and self.emulate:  # the CPU kernels stand in for TorchRec's GPU ones
            kernel, kind = "fused", "cpu"
        else:
            kind = "cuda"
        ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
        shd = _sharder()
        self.inputs = (ebc, _plan(ebc, kernel, kind, shd), shd)

    def eager(self):
        import torch.distributed as dist
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        (ebc, plan, shd), self.inputs = self.inputs, None  # the DMP takes the EBC over
        dev = torch.device("cpu") if self.emulate else self.device
        return DistributedModelParallel(ebc, ShardingEnv.from_process_group(dist.group.WORLD),
                                        device=dev, plan=plan, sharders=[shd])

    def metamat(self, ckpt=None):
        import metamat
        from metamat.emulation import emulated_cuda

        (ebc, plan, shd), self.inputs = self.inputs, None
        model = metamat.shard_on_meta(ebc, plan=plan, sharders=[shd], compute_device="cuda")
        with emulated_cuda() if self.emulate else contextlib.nullcontext():
            t = time.perf_counter()
            report = metamat.materialize(model, ckpt, progress=False)  # synchronises a GPU
            self.reports.append((report, time.perf_counter() - t))
        return model

    def timed_eager(self, cfgs, kernel: str, reps: int, dev: torch.device,
                    fn: Optional[Callable[[], object]] = None) -> float:
        """Median seconds of ``fn`` (default: the eager DMP), its input prepared untimed."""
        return _timed(fn or self.eager, reps, dev,
                      setup=lambda: self.prepare(cfgs, kernel, eager=True))

    def timed_metamat(self, cfgs, kernel: str, reps: int, dev: torch.device, ckpt=None):
        """(median seconds of shard_on_meta + materialize, [(Report, seconds of materialize)]
        of the timed calls)."""
        self.reports = []
        t = _timed(lambda: self.metamat(ckpt), reps, dev,
                   setup=lambda: self.prepare(cfgs, kernel, eager=False))
        return t, self.reports[1:]  # the first call warms up


def _fill_allocated(allocate: Callable[[], tuple], reps: int, device: torch.device) -> float:
    """Median seconds of ``fill_`` of the tensor ``allocate()`` returns first (what follows it
    keeps its memory alive), allocated untimed and untouched before each call."""
    buf: list = []

    def setup():
        buf.clear()
        buf.extend(allocate())

    sec = _timed(lambda: buf[0].fill_(0.5), reps, device, setup=setup)
    buf.clear()
    return sec


def _fill_ceiling(nbytes: int, device: torch.device, reps: int, label: str,
                  fresh: bool = False) -> Row:
    """``fill_`` of ``nbytes`` on ``device``: into memory allocated untimed before each call
    (the write ceiling of a fill phase, which writes storages the allocate phase made), or
    with ``fresh`` the allocation timed too."""
    n = max(1, nbytes // 4)
    if fresh:
        sec = _timed(lambda: torch.empty(n, device=device).fill_(0.5), reps, device)
        return Row("dmp", label, n * 4, sec, reps,
                   extra=f"allocated and written in the timed call, on {device}")
    sec = _fill_allocated(lambda: (torch.empty(n, device=device),), reps, device)
    return Row("dmp", label, n * 4, sec, reps,
               extra=f"allocated untimed (untouched), written in the timed call, on {device}")


def _unified_fill_ceiling(nbytes: int, device: torch.device, reps: int, label: str) -> Row:
    """``fill_`` from the host of unified memory of the kind metamat writes UVM tables in
    (fbgemm's managed memory through its CPU alias), allocated untimed and untouched: its
    first-touch faults are the driver's, dearer than those of plain pageable memory."""
    from metamat.allocate import _unified_storage

    n = max(1, nbytes // 4)

    def allocate():
        st, alias = _unified_storage(n * 4, device, host_mapped=False)
        return torch.empty(0, dtype=torch.float32).set_(alias, 0, (n,)), st

    sec = _fill_allocated(allocate, reps, device)
    return Row("dmp", label, n * 4, sec, reps,
               extra="fbgemm managed memory allocated untimed, written through its CPU alias")


def _median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def run_dmp_cuda(a, device: torch.device, emulate: bool = False) -> List[Row]:
    from bench_scale import process_group

    dev = torch.device("cpu") if emulate else device
    m = _Methods(device, emulate)

    def large(gib: float):
        per = int(gib * 2**30)
        return _tables(a.tables, max(8, per // (a.tables * a.dim * 4)), a.dim)

    uvm_gib = min(a.size_gib, UVM_GIB_MAX)
    n_small = getattr(a, "small_tables", 2048)
    small = _tables(n_small, SMALL_ROWS, SMALL_DIM, prefix="s")
    tag = " (emulated)" if emulate else ""
    out: List[Row] = []
    sets = (("DEVICE", large(a.size_gib), "fused", a.reps),
            ("UVM", large(uvm_gib), "fused_uvm", a.reps),
            (f"{n_small} small", small, "fused", min(a.reps, 2)))  # ~0.5 GB: Python's time
    with process_group():
        for what, cfgs, kernel, reps in sets:
            progress(f"dmp cuda: {what} tables, eager TorchRec, {reps} reps")
            eager_s = m.timed_eager(cfgs, kernel, reps, dev)
            progress(f"dmp cuda: {what} tables, metamat, {reps} reps")
            ours, reports = m.timed_metamat(cfgs, kernel, reps, dev)
            last = reports[-1][0]
            mem, nbytes = last.bytes_by_memory, last.bytes_allocated
            written = last.bytes_written
            mat_s = _median(sec for _, sec in reports)
            fill_s = _median(r.seconds.get("fill", 0.0) for r, _ in reports)
            rows = [Row("dmp", f"TorchRec DMP(cuda), {what}{tag}", nbytes, eager_s, reps),
                    Row("dmp", f"metamat, {what}{tag}", nbytes, ours, reps,
                        extra="shard_on_meta + materialize; " + ", ".join(
                            f"{k} {v / 2**30:.2f} GiB" for k, v in mem.items())),
                    Row("dmp", f"metamat materialize alone, {what}{tag}", nbytes, mat_s, reps),
                    Row("dmp", f"metamat fill phase, {what}{tag}", written, fill_s, reps,
                        extra="bytes written / the fill phase's seconds")]
            if kernel == "fused_uvm":  # written from the host: the host's write ceilings
                host = mem.get("uvm", 0) + mem.get("uvm_host_mapped", 0)
                if not emulate:
                    rows.append(_unified_fill_ceiling(host, device, reps,
                                                      f"host fill_ of unified memory, {what}"))
                rows.append(_fill_ceiling(host, torch.device("cpu"), reps,
                                          f"host fill_ of pageable memory, {what}{tag}"))
            else:
                rows.append(_fill_ceiling(mem.get("device", nbytes), dev, reps,
                                          f"device fill_, {what}{tag}"))
                rows.append(_fill_ceiling(mem.get("device", nbytes), dev, reps,
                                          f"device empty + fill_, {what}{tag}", fresh=True))
            ceil = rows[4]  # the write ceiling of the memory metamat's fill phase wrote
            finish(rows, rows[0].method, ceil.method)
            print_table(f"dmp --device cuda: {what} tables (kernel {kernel}), one rank{tag}",
                        rows, rows[0].method, ceil.method)
            fill, alone = rows[3], rows[2]
            print(f"{what}: metamat {eager_s / ours:.2f}x eager DMP(cuda) "
                  f"(materialize alone {eager_s / mat_s:.2f}x); fill phase {fill.gbps:.1f} GB/s "
                  f"= {fill.gbps / ceil.gbps:.2f}x {ceil.method} ({ceil.gbps:.1f} GB/s)"
                  + (f"; materialize alone {alone.gbps / rows[5].gbps:.2f}x {rows[5].method}"
                     if len(rows) > 5 and kernel != "fused_uvm" else ""))
            out += rows
            if getattr(a, "out", None):  # a stopped run keeps the sets it measured
                write_csv(os.path.join(a.out, "results.csv"), out)
    return out


def _read_ceiling(files: List[str], threads: int, reps: int) -> float:
    """Best seconds to read ``files`` whole from the page cache into one pinned buffer with
    ``threads`` threads taking 8 MiB requests in turn (no metamat code)."""
    req = 8 << 20
    sizes = [os.path.getsize(f) for f in files]
    try:
        buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    except RuntimeError:
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
    view = memoryview(buf.numpy())
    jobs, base = [], 0
    for f, n in zip(files, sizes):
        jobs += [(f, off, base + off, min(req, n - off)) for off in range(0, n, req)]
        base += n
    best = float("inf")
    for _ in range(max(1, reps)):
        fds = {f: os.open(f, os.O_RDONLY) for f in files}
        it, lock = iter(jobs), threading.Lock()

        def work():
            while True:
                with lock:
                    job = next(it, None)
                if job is None:
                    return
                f, off, dst, n = job
                os.preadv(fds[f], [view[dst:dst + n]], off)

        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
        for fd in fds.values():
            os.close(fd)
    return best


def _h2d_ceiling(nbytes: int, device: torch.device, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return min(_timed(lambda: dst.copy_(src, non_blocking=True), 1, device)
               for _ in range(max(1, reps)))


def run_load_cuda(a, device: torch.device, emulate: bool = False) -> List[Row]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from bench_scale import process_group
    from metamat.load import default_io_threads

    dev = torch.device("cpu") if emulate else device
    m = _Methods(device, emulate)
    per = int(a.size_gib * 2**30)
    cfgs = _tables(a.tables, max(8, per // (a.tables * a.dim * 4)), a.dim)
    tag = " (emulated)" if emulate else ""
    root = tempfile.mkdtemp(prefix="metamat-bench-load-cuda-", dir=getattr(a, "tmp", None))
    rows: List[Row] = []
    try:
        with process_group():
            progress("load cuda: writing the checkpoint")
            m.prepare(cfgs, "fused", eager=False)
            src = m.metamat()
            ckpt = os.path.join(root, "dcp")
            # no fsync: the bytes are read back from the page cache (warm), disk speed is moot
            dcp.save({"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()},
                     storage_writer=FileSystemWriter(ckpt, sync_files=False))
            del src
            _free(dev)

            def eager_load():
                model = m.eager()
                state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
                dcp.load(state, checkpoint_id=ckpt)
                model.fused_optimizer.load_state_dict(state["optim"])
                return model

            progress(f"load cuda: eager TorchRec + dcp.load, {a.reps} reps")
            eager_s = m.timed_eager(cfgs, "fused", a.reps, dev, fn=eager_load)
            progress(f"load cuda: metamat, {a.reps} reps")
            ours, reports = m.timed_metamat(cfgs, "fused", a.reps, dev, ckpt)
            need = reports[-1][0].bytes_needed
            read_phase = _median(r.seconds.get("read", 0.0) for r, _ in reports)
            files = [os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".distcp")]
            threads = default_io_threads()
            read_s = _read_ceiling(files, threads, a.reps)
            rows = [Row("load", f"TorchRec DMP(cuda) + dcp.load{tag}", need, eager_s, a.reps),
                    Row("load", f"metamat materialize(ckpt){tag}", need, ours, a.reps,
                        extra="shard_on_meta + materialize"),
                    Row("load", f"metamat read phase{tag}", need, read_phase, a.reps,
                        extra="checkpoint bytes / the read phase's seconds"),
                    Row("load", f"page-cache read into pinned memory{tag}",
                        sum(os.path.getsize(f) for f in files), read_s, a.reps,
                        extra=f"ceiling: {threads} threads, 8 MiB preads, best of reps")]
            if not emulate:
                rows.append(Row("load", "pinned H2D copy", need,
                                _h2d_ceiling(need, device, a.reps), a.reps,
                                extra="ceiling, best of reps"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    finish(rows, rows[0].method, rows[3].method)
    print_table(f"load --device cuda: {a.tables} DEVICE tables + row-wise Adagrad state, "
                f"~{a.size_gib:g} GiB, one rank, page cache warm{tag}",
                rows, rows[0].method, rows[3].method)
    ours_row = rows[1]
    goals = [f"load: metamat {ours_row.ratio_to_baseline:.2f}x eager DMP(cuda) + dcp.load "
             "(goal >= 10x)"]
    for ceil in rows[3:]:
        goals.append(f"{ours_row.gbps / ceil.gbps:.2f}x {ceil.method} ({ceil.gbps:.1f} GB/s; "
                     f"read phase alone {rows[2].gbps / ceil.gbps:.2f}x)")
    print("; ".join(goals) + " (goal >= 0.8x the read ceiling)")
    return rows
