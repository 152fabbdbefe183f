"""A/B of the CUDA init kernel's variants (csrc/include/metamat/fill_variant.h) against torch's
fill_, in one process: for fp32 / bf16 (and fp16 Uniform) x Uniform / Normal / TruncatedNormal,
every variant this build has (``METAMAT_FILL_VARIANTS=1`` builds them all; otherwise only ``base``),
the diagnostic rows (Constant through the kernel: its store path; ``philoxbits``: Philox + stores),
and 10,240 tables of 1 MiB against one table of the same bytes, per variant and tiles per block.

Rounds interleave the rows (fill_, then each variant, ...) so clock and thermal drift hit all of
them alike; each row's time is the median of its rounds. Segment tables are packed into pinned
memory before the clock; each timed call then does what ``materialize`` does per launch: splits
the segments into tiles on the host, copies the table to the device (128 bytes a segment: 1.3 MB
for 10,240 tables) and launches. GB/s are 1e9 bytes per second.

    python bench/bench_init_variants.py [--size-gib 4] [--rounds 7] [--tables 10240] [--json F]
    python bench/bench_init_variants.py --emulate     # CPU: the same rows through the emulation
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import metamat  # noqa: E402
from metamat._ext import core  # noqa: E402
from metamat.init import SEGMENT_DTYPE, _pack  # noqa: E402

DISTS = {"Uniform": metamat.Uniform(-0.1, 0.1), "Normal": metamat.Normal(0.0, 0.1),
         "TruncNormal": metamat.TruncatedNormal(0.0, 0.1, -0.2, 0.2),
         "Constant": metamat.Constant(0.5)}
GOALS = {("float32", "Uniform"): 0.9, ("float32", "Normal"): 0.75,
         ("float32", "TruncNormal"): 0.75, ("bfloat16", "Uniform"): 0.85,
         ("float16", "Uniform"): 0.85, ("bfloat16", "Normal"): 0.7}
MANY_GOAL = 1.15


class Launcher:
    """A packed segment table in pinned memory; ``run(variant, tiles)`` is one call: tiles split,
    the table copied to the device, one launch."""

    def __init__(self, items, device: torch.device, emulate: bool):
        self.C, self.emulate, self.device = core(), emulate, device
        segs = _pack(items, 0)
        self.n = len(segs)
        if emulate:
            self.table = segs
            return
        self.pinned = torch.empty(segs.nbytes, dtype=torch.uint8, pin_memory=True)
        self.table = self.pinned.numpy().view(SEGMENT_DTYPE)
        self.table[:] = segs
        self.scratch = torch.empty(segs.nbytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.current_stream(device).cuda_stream

    def run(self, variant: int, tiles: int) -> None:
        addr = self.table.ctypes.data
        if self.emulate:
            self.C.fill_cuda_emulated_variant(addr, self.n, False, variant, tiles)
        else:  # the table is rewritten by each call (prepare_launch): same input every time
            self.C.fill_cuda_variant(addr, self.n, addr, self.scratch.data_ptr(), self.stream,
                                     variant, tiles)


def timed(fns, rounds: int, device: torch.device):
    """Median seconds of each fn over `rounds` interleaved rounds (after one warm round)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = [[] for _ in fns]
    for r in range(rounds + 1):
        for i, fn in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r:
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tables", type=int, default=10240, help="tables of 1 MiB (fp32) vs one")
    p.add_argument("--tiles", default="1,2,4,8", help="tiles per block tried for many tables")
    p.add_argument("--variants", default="", help="comma-separated names (default: all built)")
    p.add_argument("--emulate", action="store_true", help="CPU: run the rows through the "
                   "kernel's host emulation (a check of this script, not a GPU number)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--profile", action="store_true", help="under a profiler (ncu): one launch "
                   "of fp32 Uniform and of fp32 Normal per variant, nothing else")
    a = p.parse_args(argv)
    C = core()
    emulate = a.emulate or not torch.cuda.is_available()
    dev = torch.device("cpu" if emulate else "cuda")
    allv = C.fill_variants()
    built = C.fill_variants_built() or emulate
    names = [v for v in a.variants.split(",") if v] or \
        [v["name"] for v in allv if built or v["id"] == 0]
    var = {v["name"]: v for v in allv if v["name"] in names}
    tiles_list = [int(t) for t in a.tiles.split(",")] if built else [1]
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "emulated (CPU)"
    print(f"# init kernel variants: {gpu}; variants {', '.join(var)}; kernels built: "
          f"{C.fill_variants_built()}; {a.size_gib} GiB per buffer, {a.rounds} rounds")
    rows = []
    if a.profile:
        buf = torch.empty(max(1, int(a.size_gib * 2**30) // 512), 128, device=dev)
        for d in ("Uniform", "Normal"):
            launch = Launcher([(buf, DISTS[d], "t", 0, 0)], dev, emulate)
            for name, v in var.items():
                launch.run(v["id"], 1)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                print(f"profiled: fp32 {d} {name}")
        return 0

    def add(**r):
        rows.append({"gpu": gpu, **r})

    for dtype, dists in ((torch.float32, ("Uniform", "Normal", "TruncNormal", "Constant")),
                         (torch.bfloat16, ("Uniform", "Normal", "TruncNormal", "Constant")),
                         (torch.float16, ("Uniform",))):
        dt = str(dtype).replace("torch.", "")
        buf = torch.empty(max(1, int(a.size_gib * 2**30) // (128 * dtype.itemsize)), 128,
                          dtype=dtype, device=dev)
        buf.fill_(1.0)
        nbytes = buf.numel() * buf.element_size()
        cases = [("torch fill_", None, None, lambda: buf.fill_(0.5))]
        for d in dists:
            launch = Launcher([(buf, DISTS[d], "t", 0, 0)], dev, emulate)
            for name, v in var.items():
                if v["diagnostic"] and d != "Uniform":
                    continue
                cases.append((f"{name}", d, v["id"],
                              lambda L=launch, i=v["id"]: L.run(i, 1)))
        secs = timed([c[3] for c in cases], a.rounds, dev)
        fill_s = secs[0]
        print(f"\n== {dt}, {nbytes / 2**30:.2f} GiB: torch fill_ {nbytes / fill_s / 1e9:.1f} GB/s")
        add(kind="fill_", dtype=dt, dist=None, variant=None, seconds=fill_s,
            gbps=nbytes / fill_s / 1e9, x_fill=1.0)
        for (name, d, vid, _), s in zip(cases[1:], secs[1:]):
            ratio = fill_s / s
            goal = GOALS.get((dt, d))
            flag = "" if goal is None or var[name]["diagnostic"] else \
                (f"  goal >= {goal:.2f}x {'MET' if ratio >= goal else 'missed'}")
            print(f"  {d:<12} {name:<12} {nbytes / s / 1e9:8.1f} GB/s  {ratio:5.2f}x fill_{flag}")
            add(kind="init", dtype=dt, dist=d, variant=name, seconds=s, gbps=nbytes / s / 1e9,
                x_fill=ratio, goal=goal, diagnostic=var[name]["diagnostic"])
        del buf, cases

    # many small tables vs one table of the same bytes (fp32 Uniform), per variant and tiles
    n_tables = a.tables if not emulate else min(a.tables, 64)
    rows_per = (1 << 20) // (128 * 4) if not emulate else 64
    big = torch.empty(n_tables * rows_per, 128, device=dev)
    small = list(big.view(n_tables, rows_per, 128).unbind(0))
    one = Launcher([(big, DISTS["Uniform"], "big", 0, 0)], dev, emulate)
    many = Launcher([(t, DISTS["Uniform"], f"t{i}", 0, 0) for i, t in enumerate(small)], dev,
                    emulate)
    cases = []
    for name, v in var.items():
        if v["diagnostic"]:
            continue
        for tiles in tiles_list:
            cases.append((name, tiles, "one", lambda i=v["id"], t=tiles: one.run(i, t)))
            cases.append((name, tiles, "many", lambda i=v["id"], t=tiles: many.run(i, t)))
    secs = timed([c[3] for c in cases], a.rounds, dev)
    nb = big.numel() * 4
    print(f"\n== {n_tables} tables of {rows_per * 512 / 2**20:.2f} MiB vs one table of "
          f"{nb / 2**30:.2f} GiB (fp32 Uniform, launch only)")
    by = {(c[0], c[1], c[2]): s for c, s in zip(cases, secs)}
    base_one = by.get(("base", 1, "one"))
    for name, tiles, _ in sorted({(c[0], c[1], 0) for c in cases}, key=lambda k: (k[0], k[1])):
        o, m = by[(name, tiles, "one")], by[(name, tiles, "many")]
        vs_base = f", many vs base one table {m / base_one:.2f}x" if base_one else ""
        print(f"  {name:<12} tiles/block {tiles}: one {nb / o / 1e9:8.1f} GB/s, many "
              f"{nb / m / 1e9:8.1f} GB/s, many/one time {m / o:.2f}x  (goal <= {MANY_GOAL})"
              f"{vs_base}")
        add(kind="many", dtype="float32", dist="Uniform", variant=name, tiles=tiles,
            tables=n_tables, one_seconds=o, many_seconds=m, many_over_one=m / o,
            many_over_base_one=(m / base_one) if base_one else None, gbps=nb / m / 1e9)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
