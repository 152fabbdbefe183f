"""Cold and warm read throughput of the C++ reader: buffered vs O_DIRECT vs auto, against the
raw sequential-read ceiling of the same file (issue 15).

    python bench/bench_io.py [--dir /tmp] [--size-mib 1024] [--reps 3] [--quick] [--csv out.csv]

Cold means the file's pages were dropped from the page cache first: fsync, then
posix_fadvise(POSIX_FADV_DONTNEED), checked with mincore (``_C.resident_fraction``): the
header prints the resident fraction before and after, so a file system that ignores the advice
shows up. The ceiling is plain O_DIRECT preads of the whole file in 8 or 32 MiB requests taken
in file order by 1/2/4/8 threads, with no metamat code involved (the best row is the ceiling).
Rows: GB/s (1e9 bytes/s), median of --reps, and % of the best ceiling.
"""
from __future__ import annotations

import argparse
import csv
import mmap
import os
import platform
import random
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from metamat import _pagecache  # noqa: E402
from metamat._ext import core  # noqa: E402

C = core()
REQ = 8 << 20


def header(path: str) -> str:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    st = os.statvfs(path)
    fs = "?"
    try:
        with open("/proc/mounts") as f:
            best = ""
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if os.path.abspath(path).startswith(mnt) and len(mnt) > len(best):
                    best, fs = mnt, f"{typ} on {dev} at {mnt}"
    except OSError:
        pass
    return (f"CPU {cpu}, {os.cpu_count()} cores, kernel {platform.release()}, "
            f"file system {fs}, {st.f_bavail * st.f_frsize / 1e9:.0f} GB free")


def make_file(path: str, size: int) -> None:
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def evict(path: str) -> tuple:
    ev = _pagecache.evict(path)
    return ev.before, ev.after


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def raw_direct(path: str, size: int, threads: int, req: int) -> None:
    """O_DIRECT preads of the whole file, `req` bytes each, threads taking the next request
    from a shared counter (the file is read front to back, `threads` requests in flight)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    nxt = [0]
    lock = threading.Lock()

    def run():
        buf = mmap.mmap(-1, req)
        while True:
            with lock:
                off = nxt[0]
                nxt[0] += req
            if off >= size:
                break
            os.preadv(fd, [buf], off)
        buf.close()

    ths = [threading.Thread(target=run) for _ in range(threads)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    os.close(fd)


def aligned_buffer(nbytes: int, shift: int):
    m = mmap.mmap(-1, nbytes + 4096)
    arr = np.frombuffer(m, dtype=np.uint8)
    return m, arr, arr.ctypes.data + shift


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 1 rep (tests)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the data file")
    ap.add_argument("--settle", type=float, default=0.5,
                    help="seconds to wait after evicting, before a cold read")
    a = ap.parse_args(argv)
    if a.quick:
        a.size_mib, a.reps, a.settle = 64, 1, 0.0
    size = a.size_mib << 20
    path = os.path.join(a.dir, f"metamat_bench_io_{size}.bin")
    print(header(a.dir))
    make_file(path, size)
    b, af = evict(path)
    print(f"eviction check (mincore): resident {b:.3f} -> {af:.3f} after fsync + "
          f"posix_fadvise(DONTNEED)")
    # Every configuration once per round, rounds repeated --reps times (medians): the device's
    # speed drifts on a shared machine, and interleaving spreads the drift over all rows.
    configs = []  # (method, cold, nbytes, run, setup, report)
    for req in (8 << 20, 32 << 20):
        for t in (1, 2, 4, 8):
            configs.append((f"raw O_DIRECT {t} thr {req >> 20} MiB", True, size,
                            (lambda t=t, req=req: raw_direct(path, size, t, req)), None))
    half = (size // 2) // 512 * 512
    buffers = []
    for case, off, n in [("whole", 0, size), ("row shard", size // 4 + 4100, half)]:
        for shift in ((0, 16) if case == "whole" else (4100 % 4096,)):
            m, arr, dst = aligned_buffer(n, shift)
            arr[:] = 0  # fault the destination in: page faults are not I/O
            op = np.array([[0, off, n, 1, 0, 0, dst, 0, 0]], dtype=np.int64)
            buffers.append((m, arr, op))
            for io in ("buffered", "direct", "auto"):
                for cold in (True, False):
                    rep = {}

                    def run(op=op, io=io, rep=rep):
                        rep.update(C.read_plan([path], op.ctypes.data, 1, io=io,
                                               threads=a.io_threads))
                        assert rep["ok"], rep["error"]
                    configs.append((f"metamat {io} {case} dst+{shift}", cold, n, run, rep))
    times = {i: [] for i in range(len(configs))}
    order = list(range(len(configs)))
    rng = random.Random(0)
    for _ in range(a.reps):
        rng.shuffle(order)  # no configuration always follows the same one
        for i in order:
            name, cold, n, run, rep = configs[i]
            if cold:
                evict(path)
                time.sleep(a.settle)  # freeing 1 GB of page cache has after-effects here
            else:
                warm(path)
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    rows = []
    for i, (name, cold, n, run, rep) in enumerate(configs):
        s_ = statistics.median(times[i])
        rows.append(dict(method=name, cache="cold" if cold else "warm", nbytes=n, seconds=s_,
                         gbps=n / s_ / 1e9,
                         extra=rep["files"][0]["mode"] if rep else ""))
    ceiling = max(r["gbps"] for r in rows if r["method"].startswith("raw"))
    w = max(len(r["method"]) for r in rows)
    print(f"{'method':<{w}}  cache  {'GB/s':>6}  {'% ceil':>6}  mode")
    for r in rows:
        r["pct_of_ceiling"] = 100 * r["gbps"] / ceiling
        print(f"{r['method']:<{w}}  {r['cache']:<5}  {r['gbps']:6.2f}  "
              f"{r['pct_of_ceiling']:5.0f}%  {r['extra']}")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    if not a.keep:
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
