"""bench/materialize.py --mode quant runs end to end in --quick mode: both methods, the same
quantized bytes, a complete CSV row each."""
import csv
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiprocess
def test_bench_quant_quick(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "materialize.py"), "--quick",
                        "--mode", "quant", "--reps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "same bytes: True" in r.stdout and "x faster, peak memory" in r.stdout
    assert "Warning" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["mode"] for row in rows] == ["quant"] * 3  # one fresh process each (--reps 1)
    for row in rows:
        for col in ("method", "nbytes", "seconds", "reps", "gbps", "ratio_to_baseline",
                    "peak_rss_gib", "extra"):
            assert row[col] not in ("", "nan"), (row["method"], col)
        assert float(row["gbps"]) > 0 and math.isfinite(float(row["seconds"]))
        assert float(row["peak_rss_gib"]) > 0


@pytest.mark.multiprocess
def test_bench_quant_sharded_quick(tmp_path):
    """--ranks 2: TorchRec's row-wise inference sharding on both sides, the same bytes."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_quant.py"), "--quick",
                        "--ranks", "2", "--reps", "1"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "shard_quant_model (RW x2)" in r.stdout and "same bytes: True" in r.stdout
    assert "x faster, peak memory" in r.stdout
