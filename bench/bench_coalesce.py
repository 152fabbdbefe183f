"""Where coalescing strided rows stops paying (issue 10): per-row preads vs one pread of the
span including the gaps, warm page cache, as a function of the slice width and the gap.

    python bench/bench_coalesce.py [--dir /tmp] [--reps 5] [--quick]

For each (width w, gap g): a strided op of w-byte rows every w+g bytes over a warm file,
read with coalesce_gap=-1 (one pread per row) and with coalescing forced (spans of up to the
256 KiB bounce window), one thread; prints ns per row for both and, per width, the largest gap
at which coalescing is still faster (the crossover) and a linear fit gap*(w) = a + b*w that
csrc/io/io_piece.cpp's coalesce rule uses.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from metamat._ext import core  # noqa: E402

C = core()
WIDTHS = [16, 64, 256, 1024, 4096, 16384]
GAPS = [0, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    widths, gaps = (WIDTHS, GAPS) if not a.quick else ([64, 4096], [0, 4096, 65536])
    if a.quick:
        a.reps, a.rows = 1, 500
    span = a.rows * (max(widths) + max(gaps))
    path = os.path.join(a.dir, f"metamat_bench_coalesce_{span}.bin")
    if not (os.path.exists(path) and os.path.getsize(path) == span):
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 256, span, dtype=np.uint8).tobytes())
    with open(path, "rb") as f:
        f.read()  # warm
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "?")
    print(f"CPU {cpu}, {os.cpu_count()} cores; warm file, 1 thread, {a.rows} rows per op, "
          f"median of {a.reps}")
    print(f"{'width':>6} {'gap':>7} {'per-row ns':>10} {'coalesced ns':>12}  faster")
    cross = {}
    for w in widths:
        dst = np.zeros(w * a.rows, dtype=np.uint8)
        best = -1
        for g in gaps:
            op = np.array([[0, 0, w, a.rows, w + g, w, dst.ctypes.data, 0, 0]], dtype=np.int64)
            res = {}
            for _ in range(a.reps):
                for name, gap in (("row", -1), ("span", 1 << 40)):
                    t0 = time.perf_counter()
                    r = C.read_plan([path], op.ctypes.data, 1, threads=1, coalesce_gap=gap,
                                    bounce_bytes=8 << 20, task_bytes=1 << 40)
                    res.setdefault(name, []).append(time.perf_counter() - t0)
                    assert r["ok"], r["error"]
            tr = statistics.median(res["row"]) / a.rows * 1e9
            ts = statistics.median(res["span"]) / a.rows * 1e9
            if ts <= tr:
                best = g
            print(f"{w:6d} {g:7d} {tr:10.0f} {ts:12.0f}  {'span' if ts <= tr else 'rows'}")
        cross[w] = best
    print("crossover (largest gap where the span read is faster):")
    for w, g in cross.items():
        print(f"  width {w:6d}: gap <= {g}")
    ws = np.array([w for w in cross if cross[w] >= 0], dtype=float)
    gs = np.array([cross[int(w)] for w in ws], dtype=float)
    if len(ws) >= 2:
        b, a0 = np.polyfit(ws, gs, 1)
        print(f"linear fit: gap* = {a0:.0f} + {b:.2f} * width")
    return 0


if __name__ == "__main__":
    sys.exit(main())
