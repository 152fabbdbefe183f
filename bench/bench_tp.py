"""--mode tp: load a tensor-parallel (Colwise/Rowwise) stack of Linear layers built on meta,
2 gloo ranks: metamat against ``to_empty`` + ``dcp.load`` and against safetensors +
``distribute_tensor``, with peak RSS and read amplification.

``--device cuda``: the same model on a ``cuda`` mesh (every rank on the one GPU when there is
only one; gloo, so ``--ranks 1`` is the honest one-GPU case), loaded into GPU memory; the
ceiling is then a pinned host-to-device copy of the rank's bytes, and safetensors +
``distribute_tensor`` is left out (it would scatter CUDA tensors over gloo).

The model is transformer-shaped (per layer: qkv d->3d and up d->4d Colwise, out d->d and down
4d->d Rowwise), ~``size_gib`` per rank. The checkpoints (a DCP directory saved by the same
plan, one safetensors file of the full tensors) are written once before timing, so every
method reads from a warm page cache. Each method runs in its own rank processes, so peak RSS
growth belongs to it alone. GB/s = this rank's local bytes / wall seconds of build + load.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import List

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _common import Row, finish, print_table  # noqa: E402

BASELINE = "dcp.load (meta -> to_empty)"


class Block(nn.Module):
    def __init__(self, d: int, dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.qkv = nn.Linear(d, 3 * d, bias=False, **kw)
        self.out = nn.Linear(d, d, bias=False, **kw)
        self.up = nn.Linear(d, 4 * d, **kw)
        self.down = nn.Linear(4 * d, d, **kw)
        self.norm = nn.LayerNorm(d, **kw)


def build(d: int, layers: int, dtype, mesh):
    """The model on meta, TP-sharded over ``mesh``."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    m = nn.Sequential(*[Block(d, dtype, "meta") for _ in range(layers)])
    plan = {}
    for i in range(layers):
        plan.update({f"{i}.qkv": ColwiseParallel(), f"{i}.up": ColwiseParallel(),
                     f"{i}.out": RowwiseParallel(), f"{i}.down": RowwiseParallel()})
    return parallelize_module(m, mesh, plan)


def shape_for(size_per_rank: int, world: int, itemsize: int, quick: bool):
    d = 512 if quick else 2048
    per_layer = 12 * d * d * itemsize
    layers = max(1, round(size_per_rank * world / per_layer))
    return d, layers


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 2**20


def _local_bytes(m: nn.Module) -> int:
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size()
               for t in list(m.parameters()) + list(m.buffers()))


def _write(rank, world, d, layers, dtype_name, out):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    from metamat import materialize as materialize_dtensor

    mesh = init_device_mesh("cpu", (world,))
    m = build(d, layers, getattr(torch, dtype_name), mesh)
    materialize_dtensor(m, seed=0)
    dcp.save(m.state_dict(), checkpoint_id=os.path.join(out, "dcp"))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in m.state_dict().items()}
    if rank == 0:
        save_file(full, os.path.join(out, "model.safetensors"))
    dist.barrier()
    return _local_bytes(m)


def _load_once(method, m, mesh, world, out, floor_src):
    """One build-and-load by ``method`` into the meta model ``m``; returns (model, read amp).
    The model's device is the mesh's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    from metamat import materialize as materialize_dtensor

    amp = float("nan")
    if method == "dcp":
        m.to_empty(device=mesh.device_type)
        dcp.load(m.state_dict(), checkpoint_id=os.path.join(out, "dcp"))
        amp = 1.0  # DCP reads the saved chunks this rank needs (same plan)
    elif method == "st_distribute":
        from safetensors.torch import load_file
        full = load_file(os.path.join(out, "model.safetensors"))
        for name, mod in m.named_modules():
            for k, p in list(mod._parameters.items()):
                if p is None:
                    continue
                t = full.pop(f"{name}.{k}" if name else k)
                if hasattr(p, "placements"):
                    t = distribute_tensor(t, mesh, p.placements)
                mod._parameters[k] = nn.Parameter(t, requires_grad=p.requires_grad)
        amp = float(world)  # every rank reads the whole file
    elif method in ("metamat_dcp", "metamat_st"):
        src = "dcp" if method == "metamat_dcp" else "model.safetensors"
        amp = materialize_dtensor(m, os.path.join(out, src), progress=False).read_amplification
    elif method == "metamat_init":
        materialize_dtensor(m, seed=0)
    else:  # floor: allocate this rank's bytes and copy them from memory (no file, no format;
        # on a GPU from pinned host memory: the PCIe ceiling)
        dst = torch.empty_like(floor_src, device=mesh.device_type)
        dst.copy_(floor_src, non_blocking=True)
        m = dst
    if mesh.device_type == "cuda":
        torch.cuda.synchronize()
    return m, amp


def _rank(rank, world, methods, d, layers, dtype_name, reps, out, threads, device_type="cpu"):
    import resource

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(threads)
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dtype = getattr(torch, dtype_name)
    mesh = init_device_mesh(device_type, (world,))
    nbytes = _local_bytes(build(d, layers, dtype, mesh))
    res = {}
    for method in methods:
        floor_src = None
        if method == "floor":
            floor_src = torch.ones(nbytes // 4, dtype=torch.float32)
            if device_type == "cuda":
                floor_src = floor_src.pin_memory()
        start = _rss_gib()
        times, amp = [], float("nan")
        for _ in range(reps + 1):  # the first run warms up (imports, page cache)
            dist.barrier()
            t0 = time.perf_counter()
            m, amp = _load_once(method, build(d, layers, dtype, mesh), mesh, world, out,
                                floor_src)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            del m
        del floor_src
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        res[method] = {"median_s": statistics.median(times[1:]), "peak": peak - start,
                       "bytes": nbytes, "amp": amp}
    return res


METHODS = (("dcp", BASELINE),
           ("st_distribute", "safetensors load_file + distribute_tensor"),
           ("metamat_dcp", "metamat materialize_dtensor (DCP)"),
           ("metamat_st", "metamat materialize_dtensor (safetensors)"),
           ("metamat_init", "metamat materialize_dtensor (init)"),
           ("floor", "floor: alloc + memcpy of local bytes"))
CEILING = "floor: alloc + memcpy of local bytes"
CUDA_CEILING = "floor: pinned H2D copy of local bytes"


def run_tp(a, device: torch.device) -> List[Row]:
    """Run every method in its own ``a.ranks`` gloo processes; returns the rows (printed)."""
    from _dist import run_dist

    cuda = device.type == "cuda"
    methods = [(m, CUDA_CEILING if m == "floor" and cuda else label) for m, label in METHODS
               if not (cuda and m == "st_distribute")]
    ceiling = CUDA_CEILING if cuda else CEILING
    dtype = getattr(torch, a.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    d, layers = shape_for(int(a.size_gib * 2**30), a.ranks, itemsize, a.quick)
    threads = max(1, (os.cpu_count() or 2) // a.ranks)
    out = tempfile.mkdtemp(prefix="metamat_bench_tp_")
    rows = []
    try:
        run_dist(_write, a.ranks, d, layers, a.dtype, out)
        # Each method in its own processes (peak RSS is then its own); --quick runs them all
        # in one set of processes to save the start-up cost, and reports no RSS.
        groups = [[m for m, _ in methods]] if a.quick else [[m] for m, _ in methods]
        per = {}
        for g in groups:
            for r in run_dist(_rank, a.ranks, g, d, layers, a.dtype, a.reps, out, threads,
                              device.type):
                for k, v in r.items():
                    per.setdefault(k, []).append(v)
        for method, label in methods:
            res = per[method]
            rss = float("nan") if a.quick else max(r["peak"] for r in res)
            amp = max(r["amp"] for r in res)
            rows.append(Row("tp", label, res[0]["bytes"], max(r["median_s"] for r in res), a.reps,
                            peak_rss_gib=rss,
                            extra=(f"read amp {amp:.2f}, " if amp == amp else "")
                            + f"{a.ranks} ranks, per-rank bytes"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    finish(rows, BASELINE, ceiling)
    print_table(f"tp: {layers} layers, d={d}, {a.dtype}, ~{rows[0].nbytes / 2**30:.2f} GiB/rank, "
                f"{a.ranks} ranks on {device.type}, warm page cache", rows, BASELINE, ceiling)
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args()
    if args.quick:
        args.size_gib, args.reps = min(args.size_gib, 1 / 16), 3
    run_tp(args, torch.device(args.device))
