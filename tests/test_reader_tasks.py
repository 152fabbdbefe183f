"""How the C++ reader cuts a call into tasks: calls holding less than ``task_bytes`` per
thread are cut finer (down to 2 MiB of file span) so every thread gets a share. A staging chunk of 24 MiB
read by 8 threads used to be 3 tasks of 8 MiB (3 threads busy, 5 idle): on the H100 machine
staged loads ran at the speed of 2-3 reader threads. Results report the task and thread
counts, and the bytes are exact whatever the cut. A staging pipeline reads all its chunks, over
all its run() calls, with one crew of threads (csrc/include/metamat/io_reader.h ReadCrew)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from metamat._ext import core
from reader_ops import RAW, F32, BF16, addr, ops, poisoned

C = core()
MiB = 1 << 20


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    body = np.random.default_rng(3).integers(0, 256, 40 * MiB, dtype=np.uint8)
    p = tmp_path_factory.mktemp("tasks") / "data.bin"
    body.tofile(p)
    return str(p), body


def _read(path, arr, threads, **kw):
    return C.read_plan([path], arr.ctypes.data, len(arr), threads=threads, io="buffered", **kw)


@pytest.mark.parametrize("nbytes,threads,tasks", [
    (8 * MiB, 4, 4),          # 8 MiB < 4 x 8 MiB: four 2 MiB tasks (was one)
    (3 * MiB, 4, 2),          # shares of 768 KiB are rounded up to the 2 MiB floor
    (1 * MiB, 4, 1),
    (32 * MiB, 2, 4),         # at least task_bytes per thread: cut by task_bytes as before
    (24 * MiB, 8, 8),         # the staging chunk of the docstring
    (24 * MiB + 12345, 8, 8),  # shares rounded up to whole pages
])
def test_contiguous_call_is_shared_by_every_thread(data_file, nbytes, threads, tasks):
    path, body = data_file
    dst = poisoned(nbytes)
    started = C.reader_threads_started()
    r = _read(path, ops((0, 4096, nbytes, 1, 0, 0, addr(dst), RAW, RAW)), threads)
    assert r["ok"], r["error"]
    assert C.reader_threads_started() - started == min(threads, tasks) - 1
    assert r["tasks"] == tasks
    assert r["threads"] == min(threads, tasks)
    assert np.array_equal(dst, body[4096:4096 + nbytes])


def test_strided_and_converting_ops_are_cut_by_rows(data_file):
    path, body = data_file
    # 2,048 rows of 4 KiB every 8 KiB (8 MiB of rows over a 16 MiB span), 4 threads: shares
    # of the span, 4 MiB = 512 rows
    rows, row, stride = 2048, 4096, 8192
    dst = poisoned(rows * row)
    r = _read(path, ops((0, 100, row, rows, stride, row, addr(dst), RAW, RAW)), 4)
    assert r["ok"] and r["tasks"] == 4 and r["threads"] == 4
    want = np.stack([body[100 + i * stride: 100 + i * stride + row] for i in range(rows)])
    assert np.array_equal(dst.reshape(rows, row), want)
    # fp32 -> bf16 of 6 MiB: 3 threads, shares of 2 MiB of source bytes
    n = 6 * MiB
    out = np.zeros(n // 2, dtype=np.uint8)
    r = _read(path, ops((0, 0, n, 1, 0, 0, addr(out), F32, BF16)), 3)
    assert r["ok"] and r["tasks"] == 3 and r["threads"] == 3
    import torch
    src = torch.from_numpy(body[:n].copy()).view(torch.float32)
    got = torch.from_numpy(out).view(torch.bfloat16)
    ok = ~src.isnan()  # random bits hold NaNs (payloads may be kept or not)
    assert torch.equal(got[ok].view(torch.int16), src[ok].to(torch.bfloat16).view(torch.int16))
    assert got[~ok].isnan().all()


def test_small_task_bytes_are_kept(data_file):
    # a caller asking for tasks under the floor gets them (tests, fine-grained balance)
    path, body = data_file
    dst = poisoned(MiB)
    r = _read(path, ops((0, 0, MiB, 1, 0, 0, addr(dst), RAW, RAW)), 2, task_bytes=64 << 10)
    assert r["ok"] and r["tasks"] == 16
    assert np.array_equal(dst, body[:MiB])


def test_staged_chunks_use_every_reader_thread(data_file):
    path, body = data_file
    # 24 MiB through two 6 MiB buffers, 3 threads: 4 chunks of 3 tasks (was 1 task each)
    n = 24 * MiB
    dst = np.zeros(n, dtype=np.uint8)
    arr = ops((0, 0, n, 1, 0, 0, addr(dst), RAW, RAW))
    sinks = np.zeros(1, dtype=np.int64)
    started = C.reader_threads_started()
    p = C.StagePipeline(2, 6 * MiB, [{"kind": "host"}])
    try:
        r = p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=3, io="buffered")
    finally:
        p.close()
    assert r["ok"] and r["chunks"] == 4 and r["tasks"] == 12 and r["threads"] == 3
    assert np.array_equal(dst, body[:n])
    # one crew for the 4 chunks: its 2 helper threads start once (were 2 per chunk)
    assert C.reader_threads_started() - started == 2
    # each chunk reports its own bytes: the sum is the load (not a running total)
    assert r["bytes_read"] == n and r["files"][0]["bytes_buffered"] == n
    for k in ("wait_seconds", "read_seconds", "queue_seconds"):
        assert r[k] >= 0.0
    assert r["read_seconds"] > 0.0


def test_one_crew_per_pipeline_across_runs_and_per_load(data_file, monkeypatch):
    """A load calls StagePipeline.run once per batch of ops: the crew is kept across those
    calls (until close), and made anew only when the files or options change."""
    path, body = data_file
    n = 12 * MiB
    dst = np.zeros(n, dtype=np.uint8)
    sinks = np.zeros(1, dtype=np.int64)
    started = C.reader_threads_started()
    p = C.StagePipeline(2, 6 * MiB, [{"kind": "host"}])
    try:
        for k in range(3):  # three runs, 4 MiB each, same options: one crew
            arr = ops((0, k * 4 * MiB, 4 * MiB, 1, 0, 0, addr(dst, k * 4 * MiB), RAW, RAW))
            assert p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=3,
                         io="buffered")["ok"]
        assert C.reader_threads_started() - started == 1  # 4 MiB: two 2 MiB tasks
        arr = ops((0, 0, 6 * MiB, 1, 0, 0, addr(dst), RAW, RAW))
        assert p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=3,
                     io="buffered")["ok"]  # 3 tasks: the crew grows by one thread
        assert C.reader_threads_started() - started == 2
        assert p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=2,
                     io="buffered")["ok"]  # other options: a new crew
        assert C.reader_threads_started() - started == 3
    finally:
        p.close()
    assert np.array_equal(dst, body[:n])
    # through the Python API: many batches of one staged load, one crew
    import torch
    from safetensors.torch import save_file
    from metamat.checkpoint import open_checkpoint
    from metamat.load import load_targets, ops as load_ops
    from metamat.plan import Target
    sd = {f"t{i}": torch.randn(1024, 1024) for i in range(4)}  # 4 x 4 MiB
    st = str(Path(path).parent / "m.safetensors")
    save_file(sd, st)
    monkeypatch.setattr(load_ops, "BATCH_BYTES", 4 << 20)  # 4 runs of 4 MiB: 2 tasks each
    tg = [Target(k, k, (1024, 1024), (0, 0), (1024, 1024), torch.float32,
                 tensor=torch.empty(1024, 1024)) for k in sd]
    started = C.reader_threads_started()
    with open_checkpoint(st) as ck:
        s = load_targets(tg, ck, staged=True, io_threads=4, staging_bytes=16 << 20,
                         io="buffered")
    assert s.stage.chunks == 4 and s.stage.reader_threads == 2
    assert C.reader_threads_started() - started == 1  # a crew per run would start 4
    for t in tg:
        assert torch.equal(t.tensor, sd[t.fqn])


@pytest.mark.slow
def test_crew_under_thread_sanitizer(tmp_path):
    """fuzz/stress_read_crew.cpp under ThreadSanitizer: many calls on one crew (random ops,
    verified reads, injected read failures, buffered and direct I/O), then staging pipelines
    on two threads sharing the ring cache; results exact, no race reported (a race put into
    the helpers' bookkeeping is reported: checked by hand)."""
    import glob
    import os
    import shutil
    import subprocess
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under make sanitize (ASan preloaded): a TSan binary cannot run there")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, "csrc")):
        pytest.skip("no csrc/ beside the tests (a copied test tree)")
    exe = str(tmp_path / "stress_read_crew")
    src = [os.path.join(root, "fuzz", "stress_read_crew.cpp")] + sorted(
        glob.glob(os.path.join(root, "csrc", "io", "*.cpp")) +
        glob.glob(os.path.join(root, "csrc", "stage", "*.cpp")))  # the Makefile's FUZZ_IO_SRC
    inc = ["-I" + os.path.join(root, "csrc", "include"), "-I" + os.path.join(root, "csrc")]
    subprocess.run([gxx, "-std=c++17", "-g", "-O1", "-fsanitize=thread"] + inc + src
                   + ["-o", exe, "-lpthread"],
                   check=True, timeout=600)
    r = subprocess.run([exe, "60"], capture_output=True, text=True, timeout=600,
                       env={**{k: v for k, v in os.environ.items()
                                  if k not in ("LD_PRELOAD", "ASAN_OPTIONS")},
                            "TSAN_OPTIONS": "halt_on_error=1:exitcode=66"})
    assert r.returncode == 0, r.stderr[-6000:]
    assert "crew stress: 60 calls x 4 crews ok; 40 pipelines x 3 runs on 2 threads ok" in r.stdout
    assert "ThreadSanitizer" not in r.stderr
