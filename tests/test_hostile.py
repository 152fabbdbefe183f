"""Hostile checkpoints (tests/hostile_gen.py): every corrupted variant of valid DCP,
safetensors, HF shard sets and torch.save files raises a named CheckpointError through
open_checkpoint and load_targets, never crashes or hangs, and leaves poisoned destinations
untouched; plus a short run of each fuzz harness (fuzz/)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

import hostile_gen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = hostile_gen.all_variants()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return hostile_gen.make_bases(str(tmp_path_factory.mktemp("bases")))


@pytest.fixture
def alarm():
    """Fail instead of hanging: SIGALRM after 30 s raises in the test."""
    def on_alarm(*_):
        raise TimeoutError("hostile variant took more than 30 s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_enough_variants():
    assert len(VARIANTS) >= 30
    kinds = {v.base for v in VARIANTS}
    assert kinds == {"st", "hf", "ts", "dcp", "dcpst"}


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_variant(variant, bases, tmp_path, reader, alarm):
    hostile_gen.check_variant(variant, bases, str(tmp_path))


def test_all_variants_in_a_subprocess(tmp_path, reader):
    """The same checks in a child: a crash (segfault, abort) fails this test, not the run."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "hostile_gen.py")],
                       capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert f"{len(VARIANTS)} variants, 0 failures" in r.stdout


# --- fuzz harnesses: a short run each (the long run is `make fuzz`) -------------------------

HARNESSES = ["safetensors", "torch_save", "dcp"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("atheris")
    out = str(tmp_path_factory.mktemp("corpus"))
    subprocess.run([sys.executable, os.path.join(ROOT, "fuzz", "seeds.py"), out], check=True,
                   timeout=120)
    return out


@pytest.mark.parametrize("harness", HARNESSES)
def test_fuzz_harness_short_run(harness, corpus, tmp_path, reader):
    work = str(tmp_path / "corpus")
    shutil.copytree(os.path.join(corpus, harness), work)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "fuzz", f"fuzz_{harness}.py"), "-runs=2000",
         "-timeout=20", "-seed=1", f"-artifact_prefix={tmp_path}/", work],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, METAMAT_FUZZ_TMP=str(tmp_path / "scratch")))
    assert r.returncode == 0, r.stderr[-6000:]
    done = re.search(r"Done (\d+) runs", r.stderr)  # atheris also counts the seed inputs
    assert done and int(done.group(1)) >= 2000, r.stderr[-2000:]


@pytest.mark.slow
def test_fuzz_read_ops_short_run(tmp_path):
    """The libFuzzer harness of the C++ reader (clang), else its g++ standalone driver."""
    import glob
    src = [os.path.join(ROOT, "fuzz", "fuzz_read_ops.cpp")] + sorted(
        glob.glob(os.path.join(ROOT, "csrc", "io_*.cpp")) +
        glob.glob(os.path.join(ROOT, "csrc", "xxh3*.cpp")))  # as the Makefile's FUZZ_IO_SRC
    exe = str(tmp_path / "fuzz_read_ops")
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    clang = shutil.which("clang++")
    if clang:
        cmd = [clang, "-std=c++17", "-g", "-O1", "-fsanitize=fuzzer," + san[0][11:], san[1]]
    elif shutil.which("g++"):
        cmd = ["g++", "-std=c++17", "-g", "-O1", "-DMETAMAT_FUZZ_STANDALONE"] + san
    else:
        pytest.skip("no C++ compiler")
    subprocess.run(cmd + ["-I" + os.path.join(ROOT, "csrc")] + src + ["-o", exe, "-lpthread"],
                   check=True, timeout=300)
    args = [exe, "-runs=2000", "-seed=1"] if clang else [exe, "2000"]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
    r = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=str(tmp_path),
                       env=env)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "Done 2000 runs" in r.stdout + r.stderr
