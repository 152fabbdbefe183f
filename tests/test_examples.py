"""The examples run end to end at small sizes, as their docstrings say to run them: one process
(``python``) or two gloo ranks (``torchrun --nproc_per_node 2``). Each prints ``OK`` only when
its own checks pass (and exits 1 otherwise)."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run(script, args, ranks, tmp_path):
    path = os.path.join(EXAMPLES, script)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if ranks == 1:
        env["MASTER_PORT"] = str(29000 + os.getpid() % 1000)
        cmd = [sys.executable, path, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks), path, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "\nOK\n" in "\n" + r.stdout, out[-4000:]
    assert "broadcast_buffers" not in out  # metamat's DDPs raise no deprecation warning
    return r.stdout


DLRM = ["--rows", "2000", "--dim", "8", "--steps", "3"]


def _dlrm_checks(out):
    assert "step 2: loss" in out
    assert "trained by the fused optimizer: 4 of 4 tables changed, 4 of 4 row-wise Adagrad" in out
    assert "(4 tables, 4 optimizer states) equal: True; outputs equal: True" in out


torchrec = pytest.mark.skipif(importlib.util.find_spec("torchrec") is None,
                              reason="torchrec is not installed")


@torchrec
def test_dlrm_example_one_rank(tmp_path):
    _dlrm_checks(_run("dlrm_meta.py", ["--ckpt", str(tmp_path / "ckpt"), *DLRM], 1, tmp_path))


@torchrec
@pytest.mark.multiprocess
def test_dlrm_example_two_ranks_torchrun(tmp_path):
    _dlrm_checks(_run("dlrm_meta.py", ["--ckpt", str(tmp_path / "ckpt"), *DLRM], 2, tmp_path))


@torchrec
@pytest.mark.multiprocess
def test_torchrec_init_example(tmp_path):
    out = _run("torchrec_init.py", ["--rows", "1000", "--dim", "16"], 2, tmp_path)
    assert "planner's plan == column-wise plan: True; == one unsharded fill_: True" in out


@torchrec
@pytest.mark.multiprocess
def test_torchrec_load_plan_example(tmp_path):
    out = _run("torchrec_load_plan.py", ["--ckpt", str(tmp_path / "ckpt"), "--rows", "1000",
                                         "--dim", "16"], 2, tmp_path)
    assert "5 tables and optimizer states equal to the saved ones: True" in out


def test_hf_local_shards_example(tmp_path):
    pytest.importorskip("transformers")
    out = _run("hf_local_shards.py", [], 1, tmp_path)
    assert "logits equal to from_pretrained: True" in out


@pytest.mark.multiprocess
def test_tensor_parallel_example(tmp_path):
    out = _run("tensor_parallel.py", ["--dim", "64", "--hidden", "256", "--out",
                                      str(tmp_path / "tp")], 2, tmp_path)
    assert "sharded init equal to the unsharded init: True" in out
    assert "loaded weights equal: True; output equal to the reference: True" in out
