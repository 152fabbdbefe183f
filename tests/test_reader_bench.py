"""The reader's benchmarks (bench/bench_io.py, bench_verify.py, bench_coalesce.py) run end to
end in --quick mode (numbers are never asserted: they are measured, not tested)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script,needle", [("bench_io.py", "raw O_DIRECT"),
                                           ("bench_verify.py", "whole file"),
                                           ("bench_coalesce.py", "crossover")])
def test_bench_quick(tmp_path, script, needle):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick",
                        "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert needle in r.stdout
