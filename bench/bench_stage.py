"""Staged loads (issue 12): a safetensors checkpoint into device tensors through the C++
staging pipeline (metamat/load/staged.py -> metamat._C.StagePipeline), against the copy
ceiling and safetensors' own loader, in the same run.

Rows (GB/s of destination bytes; staged rows: median of --reps after a first call, page
cache warm; ceilings: best of max(--reps, 3) after a warm call):
* pinned host -> device copy of the same bytes (one ``copy_(non_blocking)``: the PCIe ceiling);
* the read ceiling (``Ceilings``): the same bytes as the staged load, read by metamat's reader
  crew with the same thread count into page-locked host tensors (1 / 8 / 16 / the default
  threads); every staged row prints its ratio to the ceiling at its own thread count and to
  the H2D copy;
* ``safetensors.torch.load_file(device=...)`` (the baseline);
* metamat ``load_targets`` fp32 -> fp32 (whole tensors: contiguous copies);
* metamat fp32 -> bf16 converted on the host (the reader's copy loop: half the bytes cross
  PCIe) and on the device (METAMAT_CONVERT_ON=device: fp32 copied, a kernel converts);
* metamat from a bf16 checkpoint into bf16 (the bytes a bf16 checkpoint saves);
* metamat, column slices (strided rows: cudaMemcpy2DAsync);
* metamat with 16 and 64 MiB ``staging_bytes``, and with 8 reader threads;
* for each metamat row: the first call's time and ring allocation (the cache of the last ring
  is emptied before it) and, for the later calls (ring reused), where the pipeline thread's
  time went;
* ``--sweep``: ring size (2 x 8..96 MiB) x reader threads (4..16), each against the ceiling.

On a CPU-only machine ``--device cpu`` runs the same pipeline with the host copy sink (a check
of this script, not a GPU number).

    python bench/bench_stage.py --device cuda [--size-gib 2] [--reps 3] [--sweep] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metamat.checkpoint import open_checkpoint  # noqa: E402
from metamat.load import default_io_threads, load_targets  # noqa: E402
from metamat.load.staged import release_staging_memory  # noqa: E402
from metamat.plan import Target  # noqa: E402

from _common import timeit, times  # noqa: E402


def _best(fn, reps: int, dev: torch.device) -> float:
    """Best of ``reps`` timed calls after a warm one (a ceiling: the machine's best)."""
    return min(times(fn, reps, dev))


class Ceilings:
    """The run's ceilings, measured once per thread count: the pinned host -> device copy of
    the same bytes, and the page-cache read ceiling: the SAME bytes as the staged load (the
    same targets' rows, through metamat's own reader crew, no format parsing left out), with
    the SAME reader threads, into page-locked host memory (as the ring is), page cache warm,
    best of several. Earlier runs timed Python ``preadv`` threads over the whole file, median
    of 3 (64 MiB requests: 16 requests for 1 GiB, so 16 threads got one each and the slowest
    decided), which on the H200 VM read slower than the staged load itself."""

    def __init__(self, ck, targets_fn, dev: torch.device, reps: int):
        self.ck, self.targets_fn, self.dev, self.reps = ck, targets_fn, dev, reps
        self._read = {}
        self.h2d = None

    def read(self, threads: int, dtype=torch.float32, cslice=None) -> float:
        """Seconds to read what a staged load of (dtype, cslice) reads, with ``threads``."""
        key = (threads, dtype, cslice)
        if key not in self._read:
            tg = self.targets_fn(dtype, cslice, host=True)
            self._read[key] = _best(lambda: load_targets(
                tg, self.ck, staged=False, io="buffered", io_threads=threads), self.reps,
                torch.device("cpu"))
            del tg
        return self._read[key]

    def copy(self, nbytes: int) -> float:
        if self.h2d is None and self.dev.type == "cuda":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            devb = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
            self.h2d = _best(lambda: devb.copy_(host, non_blocking=True), self.reps, self.dev)
            del host, devb
        return self.h2d


def _staged(tg, ck, staging, threads, reps, dev, stats):
    release_staging_memory()  # the first call allocates (page-locks) its ring
    return timeit(lambda: stats.append(load_targets(
        tg, ck, staging_bytes=staging, staged=True, io="buffered", io_threads=threads)),
        reps, dev)


def _where(stats) -> str:
    first = stats[0]
    mid = sorted(stats[1:], key=lambda s: s.seconds)[len(stats[1:]) // 2]
    return (f"first call {first.seconds:.3f} s (new destinations), of which allocating the "
            f"ring {first.staging_seconds * 1e3:.1f} ms; later calls (ring reused): allocating "
            f"{mid.staging_seconds * 1e3:.1f} ms, pipeline thread waiting for buffers "
            f"{mid.stage.wait_seconds * 1e3:.1f} ms, reading {mid.stage.read_seconds * 1e3:.1f} "
            f"ms, queueing copies {mid.stage.queue_seconds * 1e3:.1f} ms; {mid.stage.chunks} "
            f"chunks, {mid.stage.reader_threads} reader threads")


SWEEP_RING_MIB = (8, 16, 32, 64, 96)
SWEEP_THREADS = (4, 8, 12, 16)


def sweep(ck, targets_fn, ceil: Ceilings, nbytes: int, reps: int, dev, out) -> None:
    """Ring size x reader threads (2 buffers each; the per-thread cap of staged.py lifted):
    GB/s of later calls (ring reused) and of the first call, against the read ceiling at the
    same thread count and the pinned H2D copy."""
    from metamat.load import staged as staged_mod

    cpus = os.cpu_count() or 2
    old = staged_mod.RING_BYTES_PER_THREAD
    print(f"\n== sweep: ring 2 x {'/'.join(map(str, SWEEP_RING_MIB))} MiB x reader threads "
          f"{'/'.join(str(t) for t in SWEEP_THREADS if t <= max(cpus, 4))}")
    try:
        for threads in SWEEP_THREADS:
            if threads > max(cpus, 4):
                continue
            rd = ceil.read(threads)
            for mib in SWEEP_RING_MIB:
                staged_mod.RING_BYTES_PER_THREAD = (mib << 20) // threads + 1
                tg = targets_fn(torch.float32, None)
                stats = []
                s = _staged(tg, ck, 1 << 30, threads, reps, dev, stats)
                first = stats[0].seconds
                rec = {"row": "sweep", "ring_mib": mib, "threads": threads, "seconds": s,
                       "gbps": nbytes / s / 1e9, "first_gbps": nbytes / first / 1e9,
                       "x_read": rd / s, "x_h2d": (ceil.copy(nbytes) / s) if ceil.h2d else None,
                       "read_gbps": nbytes / rd / 1e9}
                out.append(rec)
                print(f"  ring 2 x {mib:3d} MiB, {threads:2d} threads: {rec['gbps']:7.2f} GB/s "
                      f"(first call {rec['first_gbps']:6.2f}), {rec['x_read']:.2f}x read ceiling "
                      f"({rec['read_gbps']:.2f} GB/s)"
                      + (f", {rec['x_h2d']:.2f}x H2D" if rec["x_h2d"] else ""), flush=True)
                del tg
    finally:
        staged_mod.RING_BYTES_PER_THREAD = old


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--staging-mib", type=int, default=256)
    p.add_argument("--sweep", action="store_true",
                   help="also ring size x reader threads (about a minute at 1 GiB on a GPU)")
    p.add_argument("--only-sweep", action="store_true", help="the ceilings and the sweep only")
    p.add_argument("--json", help="write every row here (JSON list)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cols = 4096
    rows = max(1, int(a.size_gib * 2**30 / 4 / cols / a.tensors))
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(rows, cols, generator=g) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 4 for t in sd.values())
    tmp = tempfile.mkdtemp(prefix="metamat-bench-stage-")
    path = os.path.join(tmp, "m.safetensors")
    path16 = os.path.join(tmp, "m16.safetensors")
    from safetensors.torch import load_file, save_file
    save_file(sd, path)
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, path16)
    del sd
    print(f"device {dev}, {a.tensors} tensors of {rows}x{cols} fp32 = {nbytes / 2**30:.2f} GiB, "
          f"staging {a.staging_mib} MiB, reps {a.reps}, {default_io_threads()} reader threads "
          f"by default")
    out = []

    def targets_for(p_):
        def targets(dtype, cslice=None, host=False):
            with open_checkpoint(p_) as ck_:
                names = sorted(ck_.tensors())
            out_t = []
            for n in names:
                c0, c1 = cslice or (0, cols)
                if host:  # the read ceiling: the source dtype's bytes into pinned memory
                    t = torch.empty(rows, c1 - c0, dtype=ck_dtype[p_],
                                    pin_memory=dev.type == "cuda")
                    out_t.append(Target(n, n, (rows, cols), (0, c0), (rows, c1 - c0),
                                        ck_dtype[p_], tensor=t))
                else:
                    t = torch.empty(rows, c1 - c0, dtype=dtype, device=dev)
                    out_t.append(Target(n, n, (rows, cols), (0, c0), (rows, c1 - c0), dtype,
                                        tensor=t))
            return out_t
        return targets

    ck_dtype = {path: torch.float32, path16: torch.bfloat16}
    ck = open_checkpoint(path)
    ck16 = open_checkpoint(path16)
    targets = targets_for(path)
    ceil = Ceilings(ck, targets, dev, max(a.reps, 3))
    ceil16 = Ceilings(ck16, targets_for(path16), dev, max(a.reps, 3))
    threads0 = default_io_threads()

    def row(name, s, nb=nbytes, read_s=None, pcie_nb=None, **extra):
        """``nb``: the bytes the row delivers; ``pcie_nb``: those it moves host -> device
        (default ``nb``; the checkpoint's dtype's where the device converts)."""
        rec = {"row": name, "seconds": s, "gbps": nb / s / 1e9, **extra}
        msg = f"{name:60s} {s:8.3f} s {nb / s / 1e9:7.2f} GB/s"
        if read_s is not None:
            rec["x_read"] = read_s / s
            msg += f"  {read_s / s:5.2f}x read ceiling"
        h2d = ceil.copy(nbytes)
        if h2d and read_s is not None:  # the copy of the same PCIe bytes, scaled from nbytes
            rec["x_h2d"] = h2d / s * ((pcie_nb or nb) / nbytes)
            msg += f"  {rec['x_h2d']:5.2f}x H2D"
        out.append(rec)
        print(msg, flush=True)

    if dev.type == "cuda":
        row("pinned host -> device copy_ (ceiling, best of reps)", ceil.copy(nbytes))
    for threads in sorted({1, 8, 16, threads0}):
        row(f"read ceiling: same bytes, {threads} reader thread(s), into pinned memory",
            ceil.read(threads), threads=threads)
    if not a.only_sweep:
        row("safetensors load_file(device=...)",
            timeit(lambda: load_file(path, device=str(dev)), a.reps, dev))
        for name, dtype, cs, staging, threads, conv, use16 in (
                ("metamat staged fp32", torch.float32, None, a.staging_mib << 20, None, None, 0),
                ("metamat staged fp32 -> bf16, host conversion", torch.bfloat16, None,
                 a.staging_mib << 20, None, "host", 0),
                ("metamat staged fp32 -> bf16, device conversion", torch.bfloat16, None,
                 a.staging_mib << 20, None, "device", 0),
                ("metamat staged bf16 checkpoint -> bf16", torch.bfloat16, None,
                 a.staging_mib << 20, None, None, 1),
                ("metamat staged column slice [1024:3072) (2D copies)", torch.float32,
                 (1024, 3072), a.staging_mib << 20, None, None, 0),
                ("metamat staged fp32, 16 MiB staging (ring turns over)", torch.float32, None,
                 16 << 20, None, None, 0),
                ("metamat staged fp32, 64 MiB staging", torch.float32, None, 64 << 20, None,
                 None, 0),
                ("metamat staged fp32, 8 reader threads", torch.float32, None,
                 a.staging_mib << 20, 8, None, 0)):
            ck_, tfn, cl = (ck16, targets_for(path16), ceil16) if use16 else (ck, targets, ceil)
            tg = tfn(dtype, cs)
            nb = sum(t.tensor.numel() * t.tensor.element_size() for t in tg)
            old = os.environ.get("METAMAT_CONVERT_ON")
            if conv:
                os.environ["METAMAT_CONVERT_ON"] = conv
            stats = []
            try:
                s = _staged(tg, ck_, staging, threads, a.reps, dev, stats)
            finally:
                if conv:
                    os.environ.pop("METAMAT_CONVERT_ON") if old is None else \
                        os.environ.__setitem__("METAMAT_CONVERT_ON", old)
            t_used = threads or threads0
            src = ck_dtype[path16 if use16 else path].itemsize
            pcie = sum(t.tensor.numel() for t in tg) * src if conv == "device" else nb
            row(name, s, nb, read_s=cl.read(t_used, cslice=cs), pcie_nb=pcie, threads=t_used,
                first_seconds=stats[0].seconds, convert=conv)
            print(f"{'':60s} {_where(stats)}")
            del tg
    if a.sweep or a.only_sweep:
        sweep(ck, targets, ceil, nbytes, a.reps, dev, out)
    ck.close()
    ck16.close()
    for f in (path, path16):
        os.remove(f)
    os.rmdir(tmp)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(dev), "gpu": torch.cuda.get_device_name(dev)
                       if dev.type == "cuda" else None, "bytes": nbytes,
                       "default_threads": threads0, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
