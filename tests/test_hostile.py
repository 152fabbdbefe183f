"""Hostile checkpoints (tests/hostile_gen.py): every corrupted variant of valid DCP,
safetensors, HF shard sets and torch.save files raises a named CheckpointError through
open_checkpoint and load_targets, never crashes or hangs, and leaves poisoned destinations
untouched; plus a short run of each fuzz harness (fuzz/)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

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

HARNESSES = ["safetensors", "torch_save", "dcp", "pickle"]


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
        glob.glob(os.path.join(ROOT, "csrc", "io", "*.cpp")) +
        glob.glob(os.path.join(ROOT, "csrc", "stage", "*.cpp")))  # as the Makefile's FUZZ_IO_SRC
    exe = str(tmp_path / "fuzz_read_ops")
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    clang = shutil.which("clang++")
    if clang:
        cmd = [clang, "-std=c++17", "-g", "-O1", "-fsanitize=fuzzer," + san[0][11:], san[1]]
    elif shutil.which("g++"):
        cmd = ["g++", "-std=c++17", "-g", "-O1", "-DMETAMAT_FUZZ_STANDALONE"] + san
    else:
        pytest.skip("no C++ compiler")
    inc = ["-I" + os.path.join(ROOT, "csrc", "include"), "-I" + os.path.join(ROOT, "csrc")]
    subprocess.run(cmd + inc + src + ["-o", exe, "-lpthread"],
                   check=True, timeout=300)
    args = [exe, "-runs=2000", "-seed=1"] if clang else [exe, "2000"]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1")
    r = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=str(tmp_path),
                       env=env)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "Done 2000 runs" in r.stdout + r.stderr


# --- reliability round 2: checks that are not one damaged file ------------------------------

def _poisoned(sd):
    from metamat.plan import Target
    out = []
    for k, t in sd.items():
        dst = torch.empty_like(t)
        dst.view(torch.uint8).fill_(hostile_gen.POISON_BYTE)
        out.append(Target(k, k, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype,
                          tensor=dst))
    return out


def _swap_same_size(p, sd, in_place):
    """Rewrite ``p`` with the tensors of ``sd`` swapped: same names, shapes, size."""
    from safetensors.torch import save_file
    tmp = p + ".new"
    save_file({"a": sd["b"], "b": sd["a"]}, tmp)
    assert os.path.getsize(tmp) == os.path.getsize(p)
    if in_place:  # same inode and size: only the mtime tells
        time.sleep(0.05)  # past the filesystem's timestamp granularity
        with open(tmp, "rb") as f, open(p, "r+b") as g:
            g.write(f.read())
        os.remove(tmp)
    else:
        os.replace(tmp, p)


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "replaced"])
def test_same_size_rewrite_after_open_is_refused(tmp_path, reader, in_place):
    """A file rewritten between open_checkpoint and the load with the same size (tensors
    swapped) is refused by the reader from the identity recorded at open."""
    from safetensors.torch import save_file
    from metamat import open_checkpoint
    from metamat.checkpoint import ReadError
    from metamat.load import load_targets
    sd = {"a": torch.arange(64.).reshape(8, 8), "b": -torch.arange(64.).reshape(8, 8)}
    p = str(tmp_path / "m.safetensors")
    save_file(sd, p)
    ck = open_checkpoint(p)
    st = os.stat(p)
    assert ck.file_identity(p) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    assert ck.file_identity(str(tmp_path / "other")) is None
    _swap_same_size(p, sd, in_place)
    targets = _poisoned(sd)
    with pytest.raises(ReadError, match="changed since the checkpoint was opened") as ei:
        load_targets(targets, ck, io_threads=2)
    assert "m.safetensors" in str(ei.value)
    assert all(bool((t.tensor.view(torch.uint8) == hostile_gen.POISON_BYTE).all())
               for t in targets)
    # reopened, the new contents load
    targets = _poisoned(sd)
    load_targets(targets, open_checkpoint(p), io_threads=2)
    assert torch.equal(targets[0].tensor, sd["b"]) and torch.equal(targets[1].tensor, sd["a"])


def test_same_size_rewrite_refused_by_materialize(tmp_path, reader):
    """The same through materialize (all-or-nothing into a real model)."""
    from safetensors.torch import save_file
    import metamat
    from metamat.checkpoint import ReadError
    with torch.device("meta"):
        m = torch.nn.Linear(8, 8)
    sd = {"weight": torch.randn(8, 8), "bias": torch.randn(8)}
    p = str(tmp_path / "m.safetensors")
    save_file(sd, p)
    ck = metamat.open_checkpoint(p)
    with open(p, "r+b") as f:  # same size: flip one data byte, then move the mtime on
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
    with pytest.raises(ReadError, match="changed since"):
        metamat.materialize(m, ck)


def test_data_file_replaced_by_symlink_loop_after_open(tmp_path, reader):
    from safetensors.torch import save_file
    from metamat import open_checkpoint
    from metamat.checkpoint import CheckpointError
    from metamat.load import load_targets
    sd = {"a": torch.ones(4, 4)}
    p = str(tmp_path / "m.safetensors")
    save_file(sd, p)
    ck = open_checkpoint(p)
    os.remove(p)
    os.symlink("loop2", p)
    os.symlink(p, str(tmp_path / "loop2"))
    targets = _poisoned(sd)
    with pytest.raises(CheckpointError, match="m.safetensors"):
        load_targets(targets, ck, io_threads=2)
    with pytest.raises(CheckpointError, match="m.safetensors"):
        open_checkpoint(p)


def test_hf_cache_snapshot_symlinks_still_load(tmp_path, reader):
    """HF cache layout: snapshots/<rev>/ holds symlinks into ../../blobs; containment is
    lexical, so these are followed."""
    from safetensors.torch import save_file
    from metamat import open_checkpoint
    from metamat.load import load_targets
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    sd = {"emb": torch.randn(5, 3), "vec": torch.randn(7)}
    save_file({"emb": sd["emb"]}, str(blobs / "sha1"))
    save_file({"vec": sd["vec"]}, str(blobs / "sha2"))
    with open(blobs / "sha3", "w") as f:
        json.dump({"weight_map": {"emb": "m-1.safetensors", "vec": "m-2.safetensors"}}, f)
    for name, blob in (("m-1.safetensors", "sha1"), ("m-2.safetensors", "sha2"),
                       ("m.safetensors.index.json", "sha3")):
        os.symlink(os.path.join("..", "..", "blobs", blob), str(snap / name))
    for path in (str(snap), str(snap / "m.safetensors.index.json")):
        targets = _poisoned(sd)
        load_targets(targets, open_checkpoint(path), io_threads=2)
        assert all(torch.equal(t.tensor, sd[t.fqn]) for t in targets)


def test_limits_are_configurable(tmp_path, monkeypatch):
    from metamat import open_checkpoint
    from metamat.checkpoint import LimitExceededError
    p = str(tmp_path / "m.pt")
    torch.save({"a": torch.ones(2), "b": {"c": torch.ones(3)}}, p)
    open_checkpoint(p)
    monkeypatch.setenv("METAMAT_MAX_PICKLE_OBJECTS", "3")
    with pytest.raises(LimitExceededError, match="METAMAT_MAX_PICKLE_OBJECTS") as ei:
        open_checkpoint(p)
    assert ei.value.env == "METAMAT_MAX_PICKLE_OBJECTS" and ei.value.maximum == 3
    monkeypatch.delenv("METAMAT_MAX_PICKLE_OBJECTS")
    monkeypatch.setenv("METAMAT_MAX_PICKLE_DEPTH", "1")
    with pytest.raises(LimitExceededError, match="METAMAT_MAX_PICKLE_DEPTH"):
        open_checkpoint(p)
    monkeypatch.delenv("METAMAT_MAX_PICKLE_DEPTH")
    # data.pkl deflated: read fine, and capped by the metadata limit
    hostile_gen.ts_compress_pkl(hostile_gen.zipfile.ZIP_DEFLATED)(p)
    assert sorted(open_checkpoint(p).tensors()) == ["a", "b.c"]
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", "64")
    with pytest.raises(LimitExceededError, match="METAMAT_MAX_METADATA_BYTES"):
        open_checkpoint(p)
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", "0")
    with pytest.raises(ValueError, match="METAMAT_MAX_METADATA_BYTES"):
        open_checkpoint(p)


def test_zip_central_directory_is_bounded(tmp_path, monkeypatch):
    import zipfile
    from metamat import open_checkpoint
    from metamat.checkpoint import LimitExceededError
    p = str(tmp_path / "m.pt")
    torch.save({"a": torch.ones(2)}, p)
    with open(p, "rb") as f:
        cd = zipfile._EndRecData(f)[zipfile._ECD_SIZE]
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", str(cd))
    open_checkpoint(p)
    monkeypatch.setenv("METAMAT_MAX_METADATA_BYTES", str(cd - 1))
    with pytest.raises(LimitExceededError, match="central directory size"):
        open_checkpoint(p)


def test_billion_laughs_pickle_is_small_and_fails_fast(monkeypatch):
    """2**40 entries in 1.3 KB: the walk visits each distinct dict once (two calls per level),
    not each reference (counted, not timed)."""
    import io
    import pickle
    from metamat.checkpoint import LimitExceededError
    from metamat.checkpoint import torch_save as ts
    raw = hostile_gen.laughs_pickle()
    assert len(raw) < 1500
    calls = [0]
    real = ts._measure

    def counted(*a):
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(ts, "_measure", counted)  # its recursion goes through the module
    with pytest.raises(LimitExceededError):
        ts._measure(pickle.load(io.BytesIO(raw)), 0, {}, set(), "x")
    assert calls[0] <= 2 * 40 + 1, calls


def test_marker_survives_a_build_attempt(tmp_path):
    """BUILD on the shared torch.device stand-in is refused and does not rename it."""
    from metamat import open_checkpoint
    from metamat.checkpoint import InvalidHeaderError
    from metamat.checkpoint import torch_save as ts
    p = str(tmp_path / "m.pt")
    torch.save({"a": torch.ones(2)}, p)
    hostile_gen._ts_pickle(hostile_gen.build_marker_pickle())(p)
    with pytest.raises(InvalidHeaderError):
        open_checkpoint(p)
    assert ts._GLOBALS[("torch", "device")].name == "device"


def test_expanded_tensor_named_error(tmp_path):
    """torch.save of an expand()ed tensor: refused at open with a named error (a size-1
    dim with stride 0, like HF's position_ids buffer, still loads)."""
    from metamat import open_checkpoint
    from metamat.checkpoint import UnsupportedFormatError
    p = str(tmp_path / "m.pt")
    torch.save({"pos": torch.arange(6).expand((1, -1)), "x": torch.ones(2)}, p)
    assert open_checkpoint(p).tensors()["pos"].global_shape == (1, 6)
    torch.save({"e": torch.arange(3.).expand(4, 3)}, p)
    with pytest.raises(UnsupportedFormatError, match="expanded view") as ei:
        open_checkpoint(p)
    assert "'e'" in str(ei.value) and ".contiguous()" in str(ei.value)


@pytest.mark.parametrize("special", ["fifo", "dev_zero"])
def test_special_files_never_hang(tmp_path, special):
    """Every metadata entry point on a FIFO / a /dev/zero symlink, in a child with a
    timeout: a blocking open or an endless read would time out."""
    code = f"""
import os, sys
sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
import hostile_gen
from metamat import open_checkpoint
from metamat.checkpoint import CheckpointError
from metamat.checkpoint.checksum import read_manifest
from metamat.checkpoint.safetensors import read_header, open_safetensors_index
from metamat.checkpoint.torch_save import parse_torch_save
d = {str(tmp_path)!r}
calls = [("x.safetensors", open_checkpoint), ("y.safetensors", read_header),
         ("x.pt", parse_torch_save), ("x.index.json", open_safetensors_index),
         ("x.xxh3.json", read_manifest), ("dcp/.metadata", None)]
os.makedirs(os.path.join(d, "dcp"))
for name, fn in calls:
    p = os.path.join(d, name)
    open(p, "w").close()
    hostile_gen.to_{'fifo' if special == 'fifo' else 'dev_zero'}(p)
    try:
        (fn or open_checkpoint)(p if fn else os.path.dirname(p))
    except CheckpointError as e:
        assert "not a regular file" in str(e), e
    else:
        raise AssertionError(name)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
