"""--mode init: the fused engine against torch's uniform_/normal_ and the fill_ ceiling.

On CPU it also runs every CPU kernel this machine has (AVX-512, AVX2, x86-64, forced through
``fill_cpu``'s ``isa``) at the bench's thread count and at 1 thread, and single-threaded fills
into fresh (never touched) pages with the prefault helper on and off (METAMAT_PREFAULT).
"""
from __future__ import annotations

import os
from typing import List

import torch

import metamat
from _common import Row, finish, peak_rss_gib, print_table, progress, timeit

DISTS = [("Uniform", metamat.Uniform(-0.1, 0.1)), ("Normal", metamat.Normal(0.0, 0.1)),
         ("TruncatedNormal", metamat.TruncatedNormal(0, 0.1, -0.2, 0.2))]
SHORT = {"TruncatedNormal": "TruncNormal"}  # table column width


def run_init(total_bytes: int, reps: int, device: torch.device, dtype: torch.dtype,
             detail: bool = True, kernels: bool = True) -> List[Row]:
    """Fill one pre-touched ~total_bytes buffer (rows of 128) every way, same run. Without
    ``detail`` (the plot's smaller sizes) only the rows, no tables and no per-kernel or
    fresh-page sections; without ``kernels`` no forced-kernel section (every CPU build at
    2 and 1 threads: the longest part of the init mode)."""
    cols = 128
    rows_n = max(1, total_bytes // (cols * torch.empty((), dtype=dtype).element_size()))
    buf = torch.empty(rows_n, cols, dtype=dtype, device=device)
    buf.fill_(1.0)  # pre-touch: every method writes into resident pages
    n = buf.numel() * buf.element_size()
    cases = [
        ("torch fill_ (write ceiling)", lambda: buf.fill_(0.5)),
        ("torch uniform_", lambda: buf.uniform_(-0.1, 0.1)),
        ("torch normal_", lambda: buf.normal_(0.0, 0.1)),
    ] + [(f"metamat {name}", lambda d=d: metamat.fill_(buf, d, key="t")) for name, d in DISTS]
    dt = str(dtype).replace("torch.", "")
    progress(f"init: {n / 2**30:.3g} GiB {dt} on {device}: torch fill_/uniform_/normal_, "
             f"metamat Uniform/Normal/TruncatedNormal{'' if detail else ' (plot sweep)'}")
    rows = [Row("init", name, n, timeit(fn, reps, device), reps, extra=dt) for name, fn in cases]
    if device.type == "cuda":
        rows += _gpu_rows(total_bytes, reps, device)
    for r in rows:
        r.peak_rss_gib = peak_rss_gib()  # the buffer is shared: process peak
    finish(rows, "torch uniform_", "torch fill_ (write ceiling)")
    if not detail:
        return rows
    print_table(f"init: {n / 2**30:.2f} GiB {dtype} on {device}", rows,
                "torch uniform_", "torch fill_ (write ceiling)")
    if device.type == "cpu" and kernels:
        rows += _cpu_kernels(buf, reps)
        del buf
        rows += _fresh_pages(total_bytes, reps, dtype)
    return rows


def _fill_isa(buf: torch.Tensor, dist, isa: str, threads: int) -> None:
    from metamat._ext import core
    from metamat.init import _pack

    segs = _pack([(buf, dist, "t", 0, 0)], 0)
    core().fill_cpu(segs.ctypes.data, len(segs), threads, isa)


def _cpu_kernels(buf: torch.Tensor, reps: int) -> List[Row]:
    """Every CPU kernel, forced, at the bench's thread count and at 1 thread (resident pages)."""
    from metamat._ext import core

    n = buf.numel() * buf.element_size()
    dt = str(buf.dtype).replace("torch.", "")
    out: List[Row] = []
    old = torch.get_num_threads()
    progress(f"init: every CPU kernel ({', '.join(core().cpu_kernels())}) at "
             f"{' and '.join(map(str, sorted({old, 1}, reverse=True)))} thread(s)")
    try:
        for threads in sorted({old, 1}, reverse=True):
            torch.set_num_threads(threads)
            ceiling = f"torch fill_ ({threads}t)"
            rows = [Row("init", ceiling, n, timeit(lambda: buf.fill_(0.5), reps, buf.device), reps,
                        extra=dt)]
            for isa in core().cpu_kernels():
                for name, d in DISTS:
                    fn = lambda d=d, isa=isa: _fill_isa(buf, d, isa, threads)  # noqa: E731
                    rows.append(Row("init", f"metamat {SHORT.get(name, name)} [{isa}, {threads}t]",
                                    n, timeit(fn, reps, buf.device), reps, extra=dt))
            base = f"metamat Uniform [{core().cpu_kernel()}, {threads}t]"
            for r in rows:
                r.peak_rss_gib = peak_rss_gib()
            finish(rows, base, ceiling)
            print_table(f"init CPU kernels: {n / 2**30:.2f} GiB {dt}, {threads} thread(s), "
                        f"resident pages", rows, base, ceiling)
            out += rows
    finally:
        torch.set_num_threads(old)
    return out


def _fresh_pages(total_bytes: int, reps: int, dtype: torch.dtype) -> List[Row]:
    """1 thread into fresh pages (a new torch.empty per rep): fill_ vs metamat, prefault on/off."""
    cols = 128
    rows_n = max(1, total_bytes // (cols * torch.empty((), dtype=dtype).element_size()))
    holder: list = []
    dt = str(dtype).replace("torch.", "")

    def fresh():
        holder.clear()  # free the previous buffer first: each rep gets new, untouched pages
        holder.append(torch.empty(rows_n, cols, dtype=dtype))

    n = rows_n * cols * torch.empty((), dtype=dtype).element_size()
    cpu = torch.device("cpu")
    old_threads, old_env = torch.get_num_threads(), os.environ.get("METAMAT_PREFAULT")
    rows: List[Row] = []
    progress("init: into fresh pages, 1 thread, prefault on/off")
    try:
        torch.set_num_threads(1)
        rows.append(Row("init", "torch fill_ fresh (1t)", n,
                        timeit(lambda: holder[0].fill_(0.5), reps, cpu, setup=fresh), reps,
                        extra=dt))
        for name, d in DISTS[:2]:
            for pf in ("1", "0"):
                os.environ["METAMAT_PREFAULT"] = pf
                fn = lambda d=d: metamat.fill_(holder[0], d, key="t")  # noqa: E731
                label = f"metamat {name} fresh, prefault {'on' if pf == '1' else 'off'}"
                rows.append(Row("init", label, n, timeit(fn, reps, cpu, setup=fresh), reps,
                                extra=dt))
    finally:
        holder.clear()
        torch.set_num_threads(old_threads)
        if old_env is None:
            os.environ.pop("METAMAT_PREFAULT", None)
        else:
            os.environ["METAMAT_PREFAULT"] = old_env
    base, ceiling = "metamat Uniform fresh, prefault off", rows[0].method
    for r in rows:
        r.peak_rss_gib = peak_rss_gib()
    finish(rows, base, ceiling)
    print_table(f"init into fresh pages: {n / 2**30:.2f} GiB {dt}, 1 thread", rows, base, ceiling)
    return rows


# ---- GPU section: the goals of the CUDA engine, measured in the same run -------------------
# (fp32 Uniform >= 0.85x fill_, Normal >= 0.6x, bf16 Uniform >= 0.6x, 10,000 small tables in
# <= 1.2x the time of one table of the same bytes)
GPU_GOALS = [  # (row compared, baseline row, goal, "min" ratio or "max" time ratio)
    ("fp32 metamat Uniform", "fp32 torch fill_", 0.85, "min"),
    ("fp32 metamat Normal", "fp32 torch fill_", 0.60, "min"),
    ("bf16 metamat Uniform", "bf16 torch fill_", 0.60, "min"),
]


def _gpu_rows(total_bytes: int, reps: int, device: torch.device) -> List[Row]:
    """fp32 and bf16 rows against their fill_ ceilings, many small tables vs one; prints goals."""
    rows: List[Row] = []
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        buf = torch.empty(max(1, total_bytes // (128 * dtype.itemsize)), 128, dtype=dtype,
                          device=device)
        buf.fill_(1.0)
        n = buf.numel() * buf.element_size()
        for name, fn in ((f"{tag} torch fill_", lambda: buf.fill_(0.5)),
                         (f"{tag} metamat Uniform", lambda: metamat.fill_(buf, metamat.Uniform(-0.1, 0.1), key="t")),
                         (f"{tag} metamat Normal", lambda: metamat.fill_(buf, metamat.Normal(0.0, 0.1), key="t"))):
            rows.append(Row("init", name, n, timeit(fn, reps, device), reps, extra="GPU goals"))
        del buf
    rows += _many_small_vs_one_big(total_bytes, reps, device)
    _print_gpu_goals(rows)
    return rows


def _many_small_vs_one_big(total_bytes: int, reps: int, device: torch.device) -> List[Row]:
    """N tables of 1 MiB vs one table of N MiB: the launch alone (segments packed before the
    clock starts: the goal) and fill_many_ end to end (Python packing of N items included)."""
    from metamat import init as fill_init
    from metamat._ext import core

    n_tables = max(1, total_bytes >> 20)
    big = torch.empty(n_tables * 2048, 128, device=device)
    small = list(big.view(n_tables, 2048, 128).unbind(0))
    items = [(t, metamat.Uniform(-0.1, 0.1), f"t{i}", 0, 0) for i, t in enumerate(small)]
    one = timeit(lambda: metamat.fill_(big, metamat.Uniform(-0.1, 0.1), key="big"), reps, device)
    segs, _ = fill_init._pack_columns(items, 0)
    if device.type == "cuda":
        launch = timeit(lambda: fill_init._fill_cuda(core(), device, segs), reps, device)
    else:  # the same rows on CPU (tests run this section without a GPU)
        launch = timeit(lambda: core().fill_cpu(segs.ctypes.data, len(segs), torch.get_num_threads()),
                        reps, device)
    many = timeit(lambda: metamat.fill_many_(items), reps, device)
    pack = timeit(lambda: fill_init._pack_columns(items, 0), reps, torch.device("cpu"))
    nb = big.numel() * 4
    del big, small
    return [Row("init", "metamat 1 table", nb, one, reps),
            Row("init", f"metamat {n_tables} x 1 MiB: one launch", nb, launch, reps,
                extra=f"time vs 1 table: {launch / one:.2f}x (segments packed before)"),
            Row("init", f"metamat {n_tables} x 1 MiB: fill_many_", nb, many, reps,
                extra=f"time vs 1 table: {many / one:.2f}x; packing {pack * 1e3:.1f} ms "
                      f"({pack / n_tables * 1e6:.2f} us/table)")]


def _print_gpu_goals(rows: List[Row]) -> None:
    by = {r.method: r for r in rows}
    print("\n== GPU goals (set for an H100; MET / MISSED in this run)")
    for name, base, goal, _ in GPU_GOALS:
        if name in by and base in by:
            ratio = by[base].seconds / by[name].seconds  # throughput ratio
            print(f"  {name:<28} {ratio:5.2f}x {base:<18} goal >= {goal:.2f}x  "
                  f"{'MET' if ratio >= goal else 'MISSED'}")
    one = by.get("metamat 1 table")
    launch = next((r for r in rows if r.method.endswith("one launch")), None)
    if one and launch:
        ratio = launch.seconds / one.seconds
        print(f"  {launch.method:<28} {ratio:5.2f}x the time of 1 table  goal <= 1.20x  "
              f"{'MET' if ratio <= 1.2 else 'MISSED'}")
