"""metamat's benchmark: every baseline and metamat in the same run, GB/s (1e9), medians.

    python bench/materialize.py                 # all modes on the built-in default model
    python bench/materialize.py --mode init --size-gib 2 --reps 5 --out bench_out
    python bench/materialize.py --mode load --cold   # checkpoint loading, page cache dropped
    python bench/materialize.py --quick         # small sizes (the test suite runs this)
    python bench/materialize.py --mode load --storage s3   # from an S3 store (bench_s3.py)
    python bench/materialize.py --mode dmp --device cuda   # TorchRec tables on the GPU
    python bench/materialize.py --mode quant    # training checkpoint -> INT8 inference model
    python bench/materialize.py --mode mc       # managed-collision tables: init and load
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import env_header, write_csv  # noqa: E402
from _quiet import quiet  # noqa: E402

MODES = ("init", "dmp", "load")  # "all"; "tp" (DTensor tensor parallel) runs on its own
# "scale" (time against table/chunk/tensor counts, bench_scale.py) also runs on its own:
# it takes minutes (seconds with --quick).


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES + ("tp", "scale", "quant", "mc", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="small sizes, at most 3 reps (for CI)")
    p.add_argument("--kernels", action="store_true",
                   help="init: also time every CPU kernel build forced, at 2 and 1 threads "
                        "(always on with --mode init; off in the default all-modes run)")
    p.add_argument("--size-gib", type=float, default=2.0, help="bytes per rank to fill or load")
    p.add_argument("--tables", type=int, default=5, help="embedding tables (dmp, load)")
    p.add_argument("--dim", type=int, default=128, help="embedding dim (dmp, load)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (dmp, load)")
    p.add_argument("--kernel", choices=("fused", "dense"), default="fused",
                   help="TorchRec compute kernel (dmp, load): fused (with row-wise Adagrad "
                        "optimizer state, materialized and loaded too) or dense")
    p.add_argument("--zch", choices=("mch", "hash"), default="mch",
                   help="mc: the managed-collision modules, MCH or multi-probe HashZch")
    p.add_argument("--cold", action="store_true",
                   help="load: evict the checkpoint's pages before every repetition and add "
                        "the raw O_DIRECT ceiling vs io=buffered/direct x 1/2/4/8 threads table")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median reported)")
    p.add_argument("--out", default=None, help="directory for results.csv and throughput.png")
    p.add_argument("--storage", choices=("local", "s3"), default="local",
                   help="load: read the checkpoint from local files or an S3 store (moto)")
    p.add_argument("--small-tables", type=int, default=2048,
                   help="dmp --device cuda: the many-small-tables case's table count")
    p.add_argument("--emulate", action="store_true",
                   help="dmp/load --device cuda: run the GPU TorchRec benches on the emulated "
                        "device (a smoke test without a GPU; its numbers mean nothing)")
    p.add_argument("--sweep", type=int, default=16,
                   help="with --out: also run init at size/sweep .. size (x4 steps) for the plot")
    a = p.parse_args(argv)
    if a.quick:
        a.size_gib, a.reps = min(a.size_gib, 1 / 16), min(a.reps, 3)
        a.small_tables = min(a.small_tables, 64)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    quiet()  # third-party warnings and TorchRec's per-table log lines (bench processes only)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, a.dtype)
    print(env_header(torch.device("cpu") if a.emulate else device))
    rows = []
    modes = MODES if a.mode == "all" else (a.mode,)
    for mode in modes:
        if mode == "init":
            from bench_init import run_init
            sizes = [a.size_gib]
            while a.out and sizes[0] > a.size_gib / a.sweep:  # smaller sizes for the plot
                sizes.insert(0, sizes[0] / 4)
            for gib in sizes:
                rows += run_init(int(gib * 2**30), a.reps, device, dtype, detail=gib == a.size_gib,
                                 kernels=a.kernels or a.mode == "init")
        elif mode == "dmp" and device.type == "cuda":
            from bench_torchrec_gpu import run_dmp_cuda
            rows += run_dmp_cuda(a, device, emulate=a.emulate)
        elif mode == "dmp":
            from bench_dmp import run_dmp
            rows += run_dmp(a, device)
        elif mode == "load" and a.storage == "s3":
            from bench_s3 import run_s3
            rows += run_s3(a, device)
        elif mode == "load" and device.type == "cuda":
            from bench_torchrec_gpu import run_load_cuda
            rows += run_load_cuda(a, device, emulate=a.emulate)
        elif mode == "load":
            from bench_load import run_load
            rows += run_load(a, device)
        elif mode == "tp":
            from bench_tp import run_tp
            rows += run_tp(a, device)
        elif mode == "scale":
            from bench_scale import run_scale
            rows += run_scale(a, device)
        elif mode == "quant":  # float training checkpoint -> quantized model (bench_quant.py)
            from bench_quant import run_quant
            rows += run_quant(a, device)
        elif mode == "mc":  # managed-collision tables (bench_mc.py)
            from bench_mc import run_mc
            rows += run_mc(a, device)
    if a.out and rows:
        from _plot import plot
        csv_path = os.path.abspath(os.path.join(a.out, "results.csv"))
        write_csv(csv_path, rows)
        try:
            plot(rows, os.path.join(a.out, "throughput.png"))
            print(f"\nwrote {csv_path} and {os.path.join(os.path.dirname(csv_path), 'throughput.png')}")
        except ImportError as e:  # a GPU box may lack matplotlib: the CSV is what matters
            print(f"\nwrote {csv_path} (no plot: {e})")
    elif rows:
        print("\n(no --out: CSV and plot not written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
