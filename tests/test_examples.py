"""The examples run end to end (small sizes): 1 rank, and 2 ranks under torchrun (gloo)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dlrm_meta.py")
ARGS = ["--rows", "2000", "--dim", "8", "--steps", "3"]


def _check(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "outputs equal to the trained model: True" in r.stdout
    assert "step 2: loss" in r.stdout


def test_dlrm_example_one_rank(tmp_path):
    env = dict(os.environ, MASTER_PORT=str(29000 + os.getpid() % 1000))
    r = subprocess.run([sys.executable, EXAMPLE, "--ckpt", str(tmp_path / "ckpt"), *ARGS],
                       capture_output=True, text=True, timeout=300, env=env)
    _check(r)


@pytest.mark.multiprocess
def test_dlrm_example_two_ranks_torchrun(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", EXAMPLE, "--ckpt", str(tmp_path / "ckpt"), *ARGS],
                       capture_output=True, text=True, timeout=300)
    _check(r)
