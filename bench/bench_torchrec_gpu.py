"""--mode dmp / --mode load with --device cuda: TorchRec tables on the GPU, one rank (a gloo
group of one in this process), every method and ceiling in the same run.

dmp (init), three table sets:

* large DEVICE tables (``--tables`` of ``--dim``, ``--size-gib`` in all, kernel ``fused``,
  row-wise Adagrad state): eager ``DistributedModelParallel(device=cuda)`` (TorchRec's own init:
  fbgemm's zeros, the kernel's uniform_, then each table's init_fn) against
  ``shard_on_meta(compute_device="cuda")`` + ``materialize``, and against ``fill_`` of the same
  device bytes (the HBM write ceiling);
* the same bytes as UVM tables (``fused_uvm``): metamat writes unified memory from the host,
  so its ceiling is ``fill_`` of fresh host memory with every CPU thread;
* many small DEVICE tables (``--small-tables`` of 1,000 x 64): TorchRec's per-table work
  against metamat's.

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
import time
from typing import Callable, List

import torch

from _common import Row, finish, print_table, progress, timeit

SMALL_ROWS, SMALL_DIM = 1000, 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds of ``reps`` calls after one warm-up; what ``fn`` returns is freed
    between calls (models do not accumulate in GPU memory)."""
    t = timeit(fn, reps, device, setup=lambda: _free(device))
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
    """Build the same tables with TorchRec (eager) or metamat, on the device or emulated."""

    def __init__(self, device: torch.device, emulate: bool):
        self.device, self.emulate = device, emulate

    def eager(self, cfgs, kernel: str):
        import torch.distributed as dist
        from torchrec import EmbeddingBagCollection
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.types import ShardingEnv

        ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
        shd = _sharder()
        if self.emulate:  # the CPU kernels stand in for TorchRec's GPU ones
            kernel, dev, kind = "fused", torch.device("cpu"), "cpu"
        else:
            dev, kind = self.device, "cuda"
        return DistributedModelParallel(ebc, ShardingEnv.from_process_group(dist.group.WORLD),
                                        device=dev, plan=_plan(ebc, kernel, kind, shd),
                                        sharders=[shd])

    def metamat(self, cfgs, kernel: str, ckpt=None):
        import metamat
        from metamat.emulation import emulated_cuda
        from torchrec import EmbeddingBagCollection

        ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
        shd = _sharder()
        model = metamat.shard_on_meta(ebc, plan=_plan(ebc, kernel, "cuda", shd),
                                      sharders=[shd], compute_device="cuda")
        with emulated_cuda() if self.emulate else contextlib.nullcontext():
            self.report = metamat.materialize(model, ckpt, progress=False)
        return model


def _fill_ceiling(nbytes: int, device: torch.device, reps: int, label: str) -> Row:
    n = max(1, nbytes // 4)
    sec = _timed(lambda: torch.empty(n, device=device).fill_(0.5), reps, device)
    return Row("dmp", label, n * 4, sec, reps, extra=f"fresh memory on {device}")


def run_dmp_cuda(a, device: torch.device, emulate: bool = False) -> List[Row]:
    from bench_scale import process_group

    dev = torch.device("cpu") if emulate else device
    m = _Methods(device, emulate)
    per = int(a.size_gib * 2**30)
    rows_per_table = max(8, per // (a.tables * a.dim * 4))
    large = _tables(a.tables, rows_per_table, a.dim)
    n_small = getattr(a, "small_tables", 2048)
    small = _tables(n_small, SMALL_ROWS, SMALL_DIM, prefix="s")
    tag = " (emulated)" if emulate else ""
    out: List[Row] = []
    with process_group():
        for what, cfgs, kernel in (("DEVICE", large, "fused"), ("UVM", large, "fused_uvm"),
                                   (f"{n_small} small", small, "fused")):
            progress(f"dmp cuda: {what} tables, eager TorchRec, {a.reps} reps")
            rows: List[Row] = []
            eager_s = _timed(lambda: m.eager(cfgs, kernel), a.reps, dev)
            progress(f"dmp cuda: {what} tables, metamat, {a.reps} reps")
            ours = _timed(lambda: m.metamat(cfgs, kernel), a.reps, dev)
            mem = m.report.bytes_by_memory
            nbytes = m.report.bytes_allocated
            rows.append(Row("dmp", f"TorchRec DMP(cuda), {what}{tag}", nbytes, eager_s, a.reps))
            rows.append(Row("dmp", f"metamat, {what}{tag}", nbytes, ours, a.reps,
                            extra=", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in mem.items())))
            if kernel == "fused_uvm":  # written from the host: the host's write ceiling
                ceil = _fill_ceiling(mem.get("uvm", 0) + mem.get("uvm_host_mapped", 0),
                                     torch.device("cpu"), a.reps, f"host fill_, {what}{tag}")
            else:
                ceil = _fill_ceiling(mem.get("device", nbytes), dev, a.reps,
                                     f"device fill_, {what}{tag}")
            rows.append(ceil)
            finish(rows, rows[0].method, ceil.method)
            print_table(f"dmp --device cuda: {what} tables (kernel {kernel}), one rank{tag}",
                        rows, rows[0].method, ceil.method)
            print(f"metamat vs its ceiling ({ceil.method}): bytes it wrote there "
                  f"{ceil.nbytes / 2**30:.2f} GiB in {ours:.3f} s -> "
                  f"{ceil.nbytes / ours / 1e9:.2f} GB/s, "
                  f"{(ceil.nbytes / ours) / (ceil.nbytes / ceil.seconds):.2f}x the ceiling")
            out += rows
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
            src = m.metamat(cfgs, "fused")
            ckpt = os.path.join(root, "dcp")
            dcp.save({"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()},
                     checkpoint_id=ckpt)
            del src
            _free(dev)

            def eager_load():
                model = m.eager(cfgs, "fused")
                state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
                dcp.load(state, checkpoint_id=ckpt)
                model.fused_optimizer.load_state_dict(state["optim"])
                return model

            progress(f"load cuda: eager TorchRec + dcp.load, {a.reps} reps")
            eager_s = _timed(eager_load, a.reps, dev)
            progress(f"load cuda: metamat, {a.reps} reps")
            ours = _timed(lambda: m.metamat(cfgs, "fused", ckpt), a.reps, dev)
            need = m.report.bytes_needed
            files = [os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".distcp")]
            threads = default_io_threads()
            read_s = _read_ceiling(files, threads, a.reps)
            rows = [Row("load", f"TorchRec DMP(cuda) + dcp.load{tag}", need, eager_s, a.reps),
                    Row("load", f"metamat materialize(ckpt){tag}", need, ours, a.reps,
                        extra=f"read phase {m.report.seconds.get('read', 0):.3f} s"),
                    Row("load", f"page-cache read into pinned memory{tag}",
                        sum(os.path.getsize(f) for f in files), read_s, a.reps,
                        extra=f"ceiling: {threads} threads, 8 MiB preads, best of reps")]
            if not emulate:
                rows.append(Row("load", "pinned H2D copy", need,
                                _h2d_ceiling(need, device, a.reps), a.reps, extra="ceiling"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    finish(rows, rows[0].method, rows[2].method)
    print_table(f"load --device cuda: {a.tables} DEVICE tables + row-wise Adagrad state, "
                f"~{a.size_gib:g} GiB, one rank, page cache warm{tag}",
                rows, rows[0].method, rows[2].method)
    return rows
