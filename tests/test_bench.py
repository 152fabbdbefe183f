"""The benchmark CLI runs end to end in --quick mode and writes a complete CSV."""
import csv
import math
import os
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
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    modes = {row["mode"] for row in rows}
    assert modes == {"init", "dmp"}
    for row in rows:
        for col in ("method", "nbytes", "seconds", "reps", "gbps", "ratio_to_baseline"):
            assert row[col] not in ("", "nan"), (row["method"], col)
        assert float(row["gbps"]) > 0 and math.isfinite(float(row["seconds"]))
