"""The staging-buffer cache (csrc/include/metamat/stage_pool.h): a closed pipeline's ring is kept
for the next one (page-locking is slow: ~2.4 GiB/s on the H100 machine), at most one ring, buffers
of the right kind and size only; ``metamat.release_staging_memory()`` and
``METAMAT_STAGING_CACHE=0`` give the memory back. On CPU the host ring goes through the same cache,
so its rules are tested here; the CUDA test checks that page-locked and plain buffers are never
mixed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import metamat
from metamat._ext import core
from reader_ops import RAW, addr, ops

C = core()
KiB = 1 << 10


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.delenv("METAMAT_STAGING_CACHE", raising=False)
    C.stage_free_cached()
    live = C.stage_live_buffers()
    yield
    assert C.stage_live_buffers() == live, "staging buffers left in use"
    C.stage_free_cached()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    body = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    p = tmp_path_factory.mktemp("pool") / "data.bin"
    body.tofile(p)
    return str(p), body


def _stage(path, off, n, ring, ring_bytes, sink=None):
    """Read n bytes at off through a fresh pipeline; returns the bytes."""
    dst = np.zeros(n, dtype=np.uint8)
    arr = ops((0, off, n, 1, 0, 0, addr(dst), RAW, RAW))
    sinks = np.zeros(1, dtype=np.int64)
    p = C.StagePipeline(ring, ring_bytes, [sink or {"kind": "host"}])
    try:
        r = p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=2, io="buffered")
        assert r["ok"], r["error"]
    finally:
        p.close()
    if sink is not None and sink["kind"] == "cuda":
        torch.cuda.synchronize()
    return dst


def test_ring_is_reused_by_the_next_pipeline(data_file):
    path, body = data_file
    s0 = C.stage_pool_stats()
    assert np.array_equal(_stage(path, 0, 300 * KiB, 3, 64 * KiB), body[:300 * KiB])
    s1 = C.stage_pool_stats()
    assert s1["misses"] - s0["misses"] == 3 and s1["hits"] == s0["hits"]
    assert s1["cached_buffers"] == 3 and s1["cached_bytes"] == 3 * 64 * KiB
    # the same shape again, other bytes: every buffer comes from the cache, values exact
    assert np.array_equal(_stage(path, 4096 + 7, 500 * KiB, 3, 64 * KiB),
                          body[4103:4103 + 500 * KiB])
    s2 = C.stage_pool_stats()
    assert s2["hits"] - s1["hits"] == 3 and s2["misses"] == s1["misses"]
    assert s2["cached_buffers"] == 3
    # buffers up to twice the need fit (60 KiB rounds up to 60 KiB; 64 KiB <= 120 KiB)
    _stage(path, 0, 200 * KiB, 2, 60 * KiB)
    s3 = C.stage_pool_stats()
    assert s3["hits"] - s2["hits"] == 2
    # the close of that ring dropped the third buffer of the earlier one: one ring at most
    assert s3["cached_buffers"] == 2 and s3["cached_bytes"] == 2 * 64 * KiB


def test_wrong_sizes_are_not_taken_and_only_the_last_ring_stays(data_file):
    path, body = data_file
    _stage(path, 0, 256 * KiB, 2, 128 * KiB)
    s0 = C.stage_pool_stats()
    # needing 16 KiB: a 128 KiB buffer is over twice that; needing 256 KiB: too small
    assert np.array_equal(_stage(path, 100, 50 * KiB, 2, 16 * KiB), body[100:100 + 50 * KiB])
    s1 = C.stage_pool_stats()
    assert s1["hits"] == s0["hits"] and s1["misses"] - s0["misses"] == 2
    assert s1["cached_buffers"] == 2 and s1["cached_bytes"] == 2 * 16 * KiB
    _stage(path, 0, 512 * KiB, 2, 256 * KiB)
    s2 = C.stage_pool_stats()
    assert s2["hits"] == s1["hits"]
    assert s2["cached_buffers"] == 2 and s2["cached_bytes"] == 2 * 256 * KiB


def test_release_and_switch_off(data_file, monkeypatch):
    path, _ = data_file
    _stage(path, 0, 200 * KiB, 2, 100 * KiB)
    cached = C.stage_pool_stats()["cached_bytes"]
    assert cached == 2 * 100 * KiB
    assert metamat.release_staging_memory() == cached
    assert C.stage_pool_stats()["cached_buffers"] == 0
    assert metamat.release_staging_memory() == 0
    monkeypatch.setenv("METAMAT_STAGING_CACHE", "0")
    _stage(path, 0, 200 * KiB, 2, 100 * KiB)
    assert C.stage_pool_stats()["cached_buffers"] == 0


def test_release_while_a_pipeline_is_open_keeps_its_ring(data_file):
    path, body = data_file
    p = C.StagePipeline(2, 64 * KiB, [{"kind": "host"}])
    try:
        assert metamat.release_staging_memory() == 0  # its ring is in use, not cached
        dst = np.zeros(300 * KiB, dtype=np.uint8)
        arr = ops((0, 0, len(dst), 1, 0, 0, addr(dst), RAW, RAW))
        sinks = np.zeros(1, dtype=np.int64)
        assert p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=2,
                     io="buffered")["ok"]
    finally:
        p.close()
    assert np.array_equal(dst, body[:300 * KiB])
    assert C.stage_pool_stats()["cached_buffers"] == 2


def test_staged_load_reports_no_allocation_the_second_time(tmp_path):
    from safetensors.torch import save_file
    from metamat.checkpoint import open_checkpoint
    from metamat.load import load_targets
    from metamat.plan import Target
    sd = {"a": torch.randn(512, 256), "b": torch.randn(300, 256)}
    save_file(sd, str(tmp_path / "m.safetensors"))
    with open_checkpoint(str(tmp_path / "m.safetensors")) as ck:
        for rep in range(2):
            tg = [Target(k, k, tuple(v.shape), (0, 0), tuple(v.shape), torch.float32,
                         tensor=torch.empty_like(v)) for k, v in sd.items()]
            before = C.stage_pool_stats()
            load_targets(tg, ck, staged=True, staging_bytes=1 << 20, io_threads=2)
            after = C.stage_pool_stats()
            for t in tg:
                assert torch.equal(t.tensor, sd[t.fqn])
            if rep == 1:
                assert after["misses"] == before["misses"] and after["hits"] > before["hits"]


@pytest.mark.cuda
def test_pinned_and_plain_buffers_are_not_mixed(data_file):
    if not torch.cuda.is_available() or not C.cuda_compiled():
        pytest.skip("needs a GPU and the CUDA backend")
    path, body = data_file
    _stage(path, 0, 128 * KiB, 2, 64 * KiB)  # plain ring cached
    s0 = C.stage_pool_stats()
    dev = torch.cuda.current_device()
    sink = {"kind": "cuda", "device": dev, "stream": torch.cuda.current_stream().cuda_stream}
    out = torch.empty(300 * KiB, dtype=torch.uint8, device="cuda")
    arr = ops((0, 0, 300 * KiB, 1, 0, 0, out.data_ptr(), RAW, RAW))
    sinks = np.zeros(1, dtype=np.int64)
    for rep in range(2):
        out.zero_()
        p = C.StagePipeline(2, 64 * KiB, [sink])
        try:
            assert p.pinned
            assert p.run([path], arr.ctypes.data, sinks.ctypes.data, 1, threads=2,
                         io="buffered")["ok"]
        finally:
            p.close()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.from_numpy(body[:300 * KiB].copy()))
        s = C.stage_pool_stats()
        if rep == 0:  # the plain ring was not taken, and is dropped for the pinned one
            assert s["hits"] == s0["hits"] and s["misses"] - s0["misses"] == 2
        else:  # the pinned ring is reused
            assert s["hits"] - s0["hits"] == 2
        assert s["cached_buffers"] == 2
