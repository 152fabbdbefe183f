"""Benchmark plumbing: environment header, timing (median of reps), result rows, CSV."""
from __future__ import annotations

import csv
import mmap
import os
import platform
import resource
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch


def env_header(device: torch.device) -> str:
    import metamat
    from metamat._ext import core

    lines = [f"metamat {metamat.__version__} (cpu kernel: {core().cpu_kernel()}, "
             f"{core().cpu_kernel_choice()}; "
             f"cuda backend built: {core().cuda_compiled()})",
             f"torch {torch.__version__}, threads {torch.get_num_threads()}"]
    for mod in ("torchrec", "fbgemm_gpu"):
        try:
            lines[-1] += f", {mod} {__import__(mod).__version__}"
        except Exception:  # version string is informational only
            lines[-1] += f", {mod} not installed"
    lines.append(f"CPU {cpu_name()}, {os.cpu_count()} logical cores, "
                 f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, "
                 f"Linux {platform.release()}, Python {platform.python_version()}")
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        lines.append(f"load average {load} (other jobs on the machine move wall-clock numbers)")
    except OSError:
        pass
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        lines.append(f"GPU {p.name}, {p.total_memory / 1e9:.0f} GB, CUDA {torch.version.cuda}")
    return "\n".join(lines)


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """One progress line per measured method (stdout, flushed), with the run's elapsed time."""
    print(f"[{time.perf_counter() - _T0:6.0f} s] {msg} ...", flush=True)


def cpu_name() -> str:
    """The CPU's model name, with its microarchitecture for AMD families that say too little
    ("AMD EPYC" in a VM): family 25 is Zen 3 (models 0x00-0x0f, 0x20-0x5f) or Zen 4."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
                if not line.strip():
                    break
    except OSError:
        return platform.processor() or "cpu"
    name = info.get("model name", platform.processor() or "cpu")
    try:
        fam, model = int(info["cpu family"]), int(info["model"])
    except (KeyError, ValueError):
        return name
    if info.get("vendor_id") == "AuthenticAMD":
        arch = {23: "Zen/Zen 2", 26: "Zen 5"}.get(fam)
        if fam == 25:
            arch = "Zen 3" if model < 0x10 or 0x20 <= model < 0x60 else "Zen 4"
        if arch:
            name += f" (family {fam} model {model}: {arch})"
    return name


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far (GiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@dataclass
class Row:
    mode: str
    method: str
    nbytes: int
    seconds: float  # median
    reps: int
    gbps: float = 0.0
    ratio_to_baseline: float = float("nan")
    pct_of_ceiling: float = float("nan")
    peak_rss_gib: float = float("nan")
    extra: str = ""


def times(fn: Callable[[], object], reps: int, device: torch.device,
          setup: Optional[Callable[[], None]] = None) -> List[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after one warm-up call (page cache,
    allocator, CUDA context), synchronising CUDA around each; ``setup`` runs before every
    call, untimed. What ``fn`` returns is dropped at once."""
    out = []
    for i in range(reps + 1):
        if setup:
            setup()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call warms up
            out.append(time.perf_counter() - t0)
    return out


def timeit(fn: Callable[[], object], reps: int, device: torch.device,
           setup: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of ``reps`` calls (after one warm-up): :func:`times`."""
    return statistics.median(times(fn, reps, device, setup))


def finish(rows: List[Row], baseline: str, ceiling: str) -> None:
    """Fill GB/s, ratio to ``baseline`` and % of ``ceiling`` (method names) in place."""
    for r in rows:
        r.gbps = r.nbytes / r.seconds / 1e9
    base = next((r for r in rows if r.method == baseline), None)
    ceil = next((r for r in rows if r.method == ceiling), None)
    for r in rows:
        if base:
            r.ratio_to_baseline = r.gbps / base.gbps
        if ceil:
            r.pct_of_ceiling = 100 * r.gbps / ceil.gbps


def print_table(title: str, rows: List[Row], baseline: str, ceiling: str) -> None:
    print(f"\n== {title}  (ratio vs {baseline}; % of {ceiling})")
    print(f"{'method':<34}{'GiB':>7}{'s (med)':>10}{'GB/s':>9}{'ratio':>8}{'%ceil':>8}{'RSS GiB':>9}  extra")
    for r in rows:
        print(f"{r.method:<34}{r.nbytes / 2**30:>7.2f}{r.seconds:>10.4f}{r.gbps:>9.2f}"
              f"{r.ratio_to_baseline:>8.2f}{r.pct_of_ceiling:>8.1f}{r.peak_rss_gib:>9.2f}  {r.extra}")


def write_csv(path: str, rows: List[Row]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0]).keys()))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def raw_direct(files: List[str], threads: int, req: int) -> int:
    """Plain O_DIRECT preads of whole ``files`` (one after another, front to back) in ``req``
    byte requests; ``threads`` threads take the next request from a shared cursor, so
    ``threads`` requests are in flight. No metamat code. Returns the bytes read."""
    work = []
    fds = [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files]
    for fd, f in zip(fds, files):
        work += [(fd, off) for off in range(0, os.path.getsize(f), req)]
    nxt, lock, done = [0], threading.Lock(), [0] * threads

    def run(i):
        buf = mmap.mmap(-1, req)  # page-aligned, reused: no page faults in the loop
        while True:
            with lock:
                j = nxt[0]
                nxt[0] += 1
            if j >= len(work):
                break
            done[i] += os.preadv(work[j][0], [buf], work[j][1])
        buf.close()

    try:
        ths = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    return sum(done)
