"""Staged loads (issue 12): a safetensors checkpoint into device tensors through the C++
staging pipeline (metamat/load/staged.py -> metamat._C.StagePipeline), against the copy
ceiling and safetensors' own loader, in the same run.

Rows (GB/s of destination bytes, median of --reps after a first call, page cache warm):
* pinned host -> device copy of the same bytes (one ``copy_(non_blocking)``: the PCIe ceiling);
* the page-cache read ceiling: ``os.preadv`` of the whole file into page-locked host memory,
  64 MiB requests, 1 / 8 / 16 threads (no format, no device copy);
* ``safetensors.torch.load_file(device=...)`` (the baseline);
* metamat ``load_targets`` fp32 -> fp32 (whole tensors: contiguous copies);
* metamat fp32 -> bf16 (converted in the reader's host copy loop: half the bytes cross PCIe);
* metamat, column slices (strided rows: cudaMemcpy2DAsync);
* metamat with smaller ``staging_bytes`` (16 to 128 MiB): smaller rings, more chunks;
* for each metamat row: the first call's time and ring allocation (the cache of the last ring
  is emptied before it) and, for the later calls (ring reused), where the pipeline thread's
  time went.
* metamat fp32 with 8 reader threads (the default is the node's CPUs shared by its ranks, at
  most 16: ``metamat.load.default_io_threads``).

On a CPU-only machine ``--device cpu`` runs the same pipeline with the host copy sink (a check
of this script, not a GPU number).

    python bench/bench_stage.py --device cuda [--size-gib 2] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metamat.checkpoint import open_checkpoint  # noqa: E402
from metamat.load import default_io_threads, load_targets  # noqa: E402
from metamat.load.staged import release_staging_memory  # noqa: E402
from metamat.plan import Target  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, reps: int, dev: torch.device) -> float:
    fn()  # warm: page cache, allocator, CUDA context
    _sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _read_file(path: str, buf, threads: int) -> None:
    """Read the whole file with ``threads`` threads of 64 MiB ``preadv`` requests into ``buf``
    (allocated once, page-locked for a GPU run, as the staging ring is)."""
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path)
    step = 64 << 20
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(off: int) -> None:
            view = memoryview(buf[off:off + step])
            while len(view):
                n = os.preadv(fd, [view], off)
                if n <= 0:
                    raise OSError(f"short read at {off}")
                view, off = view[n:], off + n
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(read, range(0, size, step)))
    finally:
        os.close(fd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--staging-mib", type=int, default=256)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cols = 4096
    rows = max(1, int(a.size_gib * 2**30 / 4 / cols / a.tensors))
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(rows, cols, generator=g) for i in range(a.tensors)}
    nbytes = sum(t.numel() * 4 for t in sd.values())
    tmp = tempfile.mkdtemp(prefix="metamat-bench-stage-")
    path = os.path.join(tmp, "m.safetensors")
    from safetensors.torch import load_file, save_file
    save_file(sd, path)
    del sd
    print(f"device {dev}, {a.tensors} tensors of {rows}x{cols} fp32 = {nbytes / 2**30:.2f} GiB, "
          f"staging {a.staging_mib} MiB, reps {a.reps}, {default_io_threads()} reader threads "
          f"by default")
    out = []

    def row(name, s, nb=nbytes):
        out.append((name, s, nb / s / 1e9))
        print(f"{name:52s} {s:8.3f} s {nb / s / 1e9:7.2f} GB/s", flush=True)

    if dev.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        devb = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        row("pinned host -> device copy_ (ceiling)",
            _time(lambda: devb.copy_(host, non_blocking=True), a.reps, dev))
        del host, devb
    file_buf = torch.empty(os.path.getsize(path), dtype=torch.uint8,
                           pin_memory=dev.type == "cuda").numpy()
    for threads in (1, 8, 16):
        row(f"page-cache read ceiling: preadv, {threads} thread(s)",
            _time(lambda: _read_file(path, file_buf, threads), a.reps, torch.device("cpu")))
    del file_buf
    row("safetensors load_file(device=...)",
        _time(lambda: load_file(path, device=str(dev)), a.reps, dev))

    def targets(dtype, cslice=None):
        with open_checkpoint(path) as ck:
            names = sorted(ck.tensors())
        out_t = []
        for n in names:
            c0, c1 = cslice or (0, cols)
            t = torch.empty(rows, c1 - c0, dtype=dtype, device=dev)
            out_t.append(Target(n, n, (rows, cols), (0, c0), (rows, c1 - c0), dtype, tensor=t))
        return out_t

    ck = open_checkpoint(path)
    for name, dtype, cs, staging in (
            ("metamat staged fp32", torch.float32, None, a.staging_mib << 20),
            ("metamat staged fp32 -> bf16 (host conversion)", torch.bfloat16, None,
             a.staging_mib << 20),
            ("metamat staged column slice [1024:3072) (2D copies)", torch.float32, (1024, 3072),
             a.staging_mib << 20),
            ("metamat staged fp32, 16 MiB staging (ring turns over)", torch.float32, None,
             16 << 20),
            ("metamat staged fp32, 32 MiB staging", torch.float32, None, 32 << 20),
            ("metamat staged fp32, 64 MiB staging", torch.float32, None, 64 << 20),
            ("metamat staged fp32, 128 MiB staging", torch.float32, None, 128 << 20),
            ("metamat staged fp32, 8 reader threads", torch.float32, None, a.staging_mib << 20)):
        tg = targets(dtype, cs)
        nb = sum(t.tensor.numel() * t.tensor.element_size() for t in tg)
        threads = 8 if "8 reader" in name else None
        stats = []
        release_staging_memory()  # the first call allocates (page-locks) its ring
        row(name, _time(lambda: stats.append(load_targets(
            tg, ck, staging_bytes=staging, staged=True, io="buffered", io_threads=threads)),
            a.reps, dev), nb)
        first = stats[0]
        mid = sorted(stats[1:], key=lambda s: s.seconds)[len(stats[1:]) // 2]
        print(f"{'':52s} first call {first.seconds:.3f} s (new destinations), of which "
              f"allocating the ring {first.staging_seconds * 1e3:.1f} ms; later calls (ring reused): "
              f"allocating {mid.staging_seconds * 1e3:.1f} ms, pipeline thread waiting for "
              f"buffers {mid.stage.wait_seconds * 1e3:.1f} ms, reading "
              f"{mid.stage.read_seconds * 1e3:.1f} ms, queueing copies "
              f"{mid.stage.queue_seconds * 1e3:.1f} ms; {mid.stage.chunks} chunks, "
              f"{mid.stage.reader_threads} reader threads")
        del tg
    ck.close()
    os.remove(path)
    os.rmdir(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
