"""The benchmark CLI runs end to end in --quick mode and writes a complete CSV."""
import csv
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_bench_quick_writes_every_column(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "metamat Uniform" in r.stdout and "TorchRec DMP" in r.stdout
    assert "dcp.load" in r.stdout and "read amplification" in r.stdout
    assert "fused kernel" in r.stdout  # the default model carries row-wise Adagrad state
    # quiet: no third-party warnings or TorchRec per-table log lines, a progress line per method
    out = r.stdout + r.stderr
    assert "caching params will be ignored" not in out and "Warning" not in out, out[-3000:]
    assert r.stdout.count("] load: ") >= 5 and r.stdout.count("] dmp: ") == 3
    assert "torch fill_ (ranks at once)" in r.stdout and "with all 2 ranks writing at once" in r.stdout
    assert "torch fill_ (paired with metamat)" in r.stdout
    assert re.search(r"\d\.\d\dx paired \(median of 3 same-process pairs, "
                     r"\d+\.\d\d-\d+\.\d\dx\)", r.stdout), r.stdout[-2000:]
    assert "results.csv" in r.stdout.splitlines()[-1]
    assert (tmp_path / "throughput.png").stat().st_size > 1000
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    modes = {row["mode"] for row in rows}
    sizes = sorted({int(row["nbytes"]) for row in rows if row["mode"] == "init"})
    assert sizes[-1] >= 16 * sizes[0]  # the plot spans at least 16x in size
    assert modes == {"init", "dmp", "load"}
    for row in rows:
        for col in ("method", "nbytes", "seconds", "reps", "gbps", "ratio_to_baseline",
                    "pct_of_ceiling", "peak_rss_gib", "extra"):
            assert row[col] not in ("", "nan"), (row["method"], col)
        assert float(row["gbps"]) > 0 and math.isfinite(float(row["seconds"]))


@pytest.mark.multiprocess
def test_bench_tp_quick(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--quick",
                        "--mode", "tp", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    methods = {row["method"] for row in rows}
    assert any("metamat" in m for m in methods) and any("dcp.load" in m for m in methods)
    assert all(float(row["gbps"]) > 0 for row in rows)


@pytest.mark.multiprocess
@pytest.mark.parametrize("zch", ["mch", "hash"])
def test_bench_mc_quick(tmp_path, zch):
    """--mode mc: managed-collision tables (MCH or HashZch modules), TorchRec against metamat,
    init and load."""
    pytest.importorskip("torchrec")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--quick",
                        "--mode", "mc", "--zch", zch, "--reps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    got = {(row["mode"], row["method"]) for row in rows}
    assert {("mc-init", "metamat shard_on_meta+materialize"),
            ("mc-load", "metamat materialize(ckpt)"), ("mc-load", "TorchRec DMP + dcp.load"),
            ("mc-init", "torch fill_ (per-rank ceiling)")} <= got, got
    assert all(float(row["gbps"]) > 0 for row in rows)
    assert all(f"{zch} modules" in row["extra"] for row in rows if "metamat" in row["method"])


@pytest.mark.multiprocess
def test_bench_load_cold_quick(tmp_path):
    """--mode load --cold: the raw O_DIRECT ceiling and buffered/direct x 1/2/4/8 threads."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--quick",
                        "--mode", "load", "--cold", "--reps", "1", "--kernel", "dense",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "raw O_DIRECT 8 thr x 32 MiB" in r.stdout and "best direct:" in r.stdout
    with open(tmp_path / "results.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["mode"] == "load_cold"]
    names = {row["method"] for row in rows}
    for io in ("buffered", "direct", "auto"):
        for t in (1, 2, 4, 8):
            assert f"metamat io={io} {t} thr/rank" in names
    assert all(float(row["gbps"]) > 0 for row in rows)


@pytest.mark.parametrize("mode", ["dmp", "load"])
def test_bench_torchrec_gpu_runs_on_the_emulated_device(mode, tmp_path):
    """--device cuda (TorchRec tables on the GPU) as a smoke test on the emulated device, so
    a GPU machine's few minutes are not spent on a broken bench."""
    pytest.importorskip("torchrec")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--quick",
                        "--mode", mode, "--device", "cuda", "--emulate", "--small-tables", "16",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    methods = [row["method"] for row in rows]
    assert all(m.endswith("(emulated)") for m in methods), methods
    if mode == "dmp":
        # eager, metamat, materialize alone, fill phase, the ceilings (device: into allocated
        # memory and with the allocation; UVM, emulated: pageable host memory)
        for what, n in (("DEVICE", 6), ("UVM", 5), ("16 small", 6)):
            assert sum(what in m for m in methods) == n, methods
            assert f"{what}: metamat " in r.stdout and "fill phase" in r.stdout
        assert "uvm 0.0" in r.stdout  # the UVM tables went to unified memory
    else:
        assert any("dcp.load" in m for m in methods) and any("pinned" in m for m in methods)
        assert any("read phase" in m for m in methods) and "goal >= 10x" in r.stdout
    assert all(float(row["gbps"]) > 0 for row in rows)
