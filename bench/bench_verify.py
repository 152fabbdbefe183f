"""Cost of verified reads (issue 14): the same warm read with and without checksum blocks.

    python bench/bench_verify.py [--dir /tmp] [--size-mib 1024] [--threads 2] [--reps 7]

Reads a warm file (pages cached) into a page-aligned destination with _C.read_plan, once
plainly and once with a 4 MiB verify block list (digests from the xxhash package, as the
manifest writer computes them), alternating, median of --reps; prints the overhead. Cases: the
whole file as one contiguous op (hashed in place in the destination), a row-wise shard (the
middle half), and a 16-wide float32 column shard of a 64-wide table (strided: the whole rows
are read to hash the blocks; the plain read is shown with and without coalescing). Also the
hash kernels alone (GB/s, 1e9). CPU seconds (user + system, all threads) are printed beside
the wall times: on a loaded machine they show the work added without the scheduling noise.
"""
from __future__ import annotations

import argparse
import mmap
import os
import platform
import resource
import statistics
import sys
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from metamat import _pagecache  # noqa: E402
from metamat._ext import core  # noqa: E402

C = core()
BLOCK = 4 << 20


def cpu() -> float:
    """CPU seconds (user + system) of this process: steadier than wall time on a shared box."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def blocks_of(path, off, n):
    rows = []
    with open(path, "rb") as f:
        f.seek(off)
        left, s = n, off
        while left:
            ln = min(BLOCK, left)
            d = xxhash.xxh3_64_intdigest(f.read(ln))
            rows.append((0, s, ln, int(np.array(d, dtype=np.uint64).view(np.int64))))
            s += ln
            left -= ln
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def evict(path: str) -> None:
    _pagecache.evict(path, check=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cold", action="store_true",
                    help="evict the file before every read (fsync + POSIX_FADV_DONTNEED)")
    ap.add_argument("--io", default="buffered", choices=["buffered", "direct", "auto"])
    a = ap.parse_args(argv)
    if a.quick:
        a.size_mib, a.reps = 64, 2
    size = a.size_mib << 20
    path = os.path.join(a.dir, f"metamat_bench_io_{size}.bin")
    if not (os.path.exists(path) and os.path.getsize(path) == size):
        with open(path, "wb") as f:
            blk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
            for s in range(0, size, len(blk)):
                f.write(blk[: min(len(blk), size - s)])
    cpu_name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.processor())
    print(f"CPU {cpu_name}, {os.cpu_count()} cores; {size / 1e9:.2f} GB "
          f"{'cold' if a.cold else 'warm'} file, io={a.io}, {a.threads} threads, "
          f"xxh3 kernel {C.xxh3_kernel()}")
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    m = mmap.mmap(-1, size)
    dst = np.frombuffer(m, dtype=np.uint8)
    dst[:] = 1  # fault in
    base = dst.ctypes.data
    # hash kernels alone
    buf = dst[: 256 << 20]
    for name, fn in (("metamat xxh3", lambda: C.xxh3_64(buf.ctypes.data, buf.nbytes)),
                     ("xxhash pkg", lambda: xxhash.xxh3_64_intdigest(memoryview(buf)))):
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(f"{name:<14} {buf.nbytes / statistics.median(ts) / 1e9:6.2f} GB/s (256 MiB, from memory)")
    half = size // 2
    rows, width = size // 256, 64  # a 64-wide float32 table, 256-byte rows
    cases = [
        ("whole file", np.array([[0, 0, size, 1, 0, 0, base, 0, 0]], dtype=np.int64), 0, size),
        ("row shard", np.array([[0, size // 4, half, 1, 0, 0, base, 0, 0]], dtype=np.int64),
         size // 4, half),
        ("column shard 16/64", np.array([[0, 16 * 4, 64, rows, 256, 64, base, 0, 0]],
                                        dtype=np.int64), 0, size),
    ]
    print(f"{'case':<20} {'plain s':>8} {'verify s':>9} {'overhead':>8}  "
          f"{'cpu s':>6} {'cpu s':>6} {'cpu +':>7}  hashed/read")
    for name, op, boff, bn in cases:
        blocks = blocks_of(path, boff, bn)
        plain, ver, cpu_p, cpu_v = [], [], [], []
        rep = {}
        for _ in range(a.reps):
            if a.cold:
                evict(path)
            c0, t0 = cpu(), time.perf_counter()
            r = C.read_plan([path], op.ctypes.data, 1, threads=a.threads, io=a.io)
            plain.append(time.perf_counter() - t0)
            cpu_p.append(cpu() - c0)
            assert r["ok"], r["error"]
            if a.cold:
                evict(path)
            c0, t0 = cpu(), time.perf_counter()
            rep = C.read_plan([path], op.ctypes.data, 1, threads=a.threads, io=a.io,
                              verify_addr=blocks.ctypes.data, verify_count=len(blocks))
            ver.append(time.perf_counter() - t0)
            cpu_v.append(cpu() - c0)
            assert rep["ok"], rep["error"]
        p, v = statistics.median(plain), statistics.median(ver)
        cp, cv = statistics.median(cpu_p), statistics.median(cpu_v)
        print(f"{name:<20} {p:8.3f} {v:9.3f} {100 * (v / p - 1):7.1f}%  "
              f"{cp:6.3f} {cv:6.3f} {100 * (cv / cp - 1):6.1f}%  "
              f"{rep['bytes_hashed'] / 1e9:.2f} GB / {rep['bytes_read'] / 1e9:.2f} GB "
              f"(reread {rep['bytes_reread'] / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
