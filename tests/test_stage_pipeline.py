"""The C++ staging pipeline (csrc/include/metamat/stage.h, metamat._C.StagePipeline) on CPU: the
host "fake copy" sink runs the same chunking, ring reuse, event ordering and error paths as the CUDA
sink, so they are checked here; the CUDA-only parts (pinned ring, copy streams, device guard,
stream ordering) are the tests marked ``cuda`` at the end."""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from metamat._ext import core
from metamat.budget import StagingBudget
from metamat.checkpoint import ChecksumMismatchError, ReadError, open_checkpoint
from metamat.checkpoint.checksum import write_manifest
from metamat.load import plan_load
from metamat.load.execute import execute_plan
from metamat.load.staged import execute_plan_staged
from metamat.load.verify import load_manifest
from reader_ops import os_threads as thread_count
from test_load import expect, on_device, outside, same_bits, target

C = core()
RAW = C.DTYPE_CODES["raw"]


@pytest.fixture
def no_leaks(request):
    """Nothing the pipeline starts or allocates outlives the test."""
    torch.randn(1 << 20).to(torch.bfloat16).sum()  # torch's own thread pools start now, not inside
    # CUDA tests: the driver and runtime start threads of their own on first use, so only the
    # C++ counters are compared there, not the process's thread count.
    os_threads = request.node.get_closest_marker("cuda") is None
    t0, py0 = thread_count(), threading.active_count()
    b0, s0 = C.stage_live_buffers(), C.stage_live_threads()
    yield
    assert C.stage_live_buffers() == b0, "staging buffers leaked"
    assert C.stage_live_threads() == s0, "copy-sink threads left running"
    assert threading.active_count() == py0
    if os_threads:
        assert thread_count(t0) <= t0, "an OS thread was left running"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("stagepipe")
    g = torch.Generator().manual_seed(1)
    sd = {"w": torch.randn(300, 70, generator=g), "v": torch.randn(50_000, generator=g),
          "h": torch.randn(33, 129, generator=g).to(torch.bfloat16)}
    path = str(d / "m.safetensors")
    save_file(sd, path)
    return sd, path


def _random_targets(sd, rng: random.Random, n: int, convert: bool):
    out = []
    for k in range(n):
        name = rng.choice(["w", "v", "h"])
        full = sd[name]
        if full.dim() == 1:
            a = rng.randrange(full.shape[0])
            off, shape = (a,), (rng.randint(1, min(3000, full.shape[0] - a)),)
            pad = 0
        else:
            r0, c0 = rng.randrange(full.shape[0]), rng.randrange(full.shape[1])
            off = (r0, c0)
            shape = (rng.randint(1, full.shape[0] - r0), rng.randint(1, full.shape[1] - c0))
            pad = rng.choice([0, 0, 3])
        dtype = full.dtype
        if convert and full.dtype == torch.float32:
            dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        out.append(target(name, full, off, shape, dtype, row_pad=pad))
    return out


def _staged_vs_direct(sd, path, tg_staged, tg_direct, ring, ring_bytes, sink=None):
    with open_checkpoint(path) as ck:
        plan_s = plan_load(tg_staged, ck)
        plan_d = plan_load(tg_direct, ck)
        budget = StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16, ring=ring, ring_bytes=ring_bytes)
        rs = execute_plan_staged(plan_s, budget, io="buffered", _host_sink=sink)
        execute_plan(plan_d, StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16), io="buffered")
    for a, b in zip(tg_staged, tg_direct):
        assert same_bits(a.tensor, b.tensor), a.fqn
        ref = expect(sd[a.fqn], a.offsets, a.local_shape).to(a.tensor.dtype)
        assert same_bits(a.tensor, ref), a.fqn
    return rs


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("ring_bytes", [64, 4096, 100_000, 1 << 22])
def test_random_plans_equal_direct_loads(ckpt, no_leaks, ring, ring_bytes):
    sd, path = ckpt
    rng = random.Random(ring * 1000 + ring_bytes)
    for _ in range(3):
        tg = _random_targets(sd, rng, rng.randint(1, 6), convert=True)
        tg2 = [target(t.fqn, sd[t.fqn], t.offsets, t.local_shape, t.tensor.dtype)
               for t in tg]  # the direct load writes contiguous copies
        _staged_vs_direct(sd, path, tg, tg2, ring, ring_bytes)


def test_many_tiny_ops_and_slow_copies(ckpt, no_leaks):
    """Hundreds of 4..12-byte ops, copies slowed down: reuse still waits for them."""
    sd, path = ckpt
    def mk():
        return [target("v", sd["v"], (i * 97,), (1 + i % 3,)) for i in range(300)]
    tg, tg2 = mk(), mk()
    for ring in (1, 2):
        for t in tg:
            t.tensor.fill_(float("nan"))
        _staged_vs_direct(sd, path, tg, tg2, ring, 64, sink={"delay_us": 50})


def _pipe_read(path, ops, ring, ring_bytes, sink=None, **kw):
    """Run packed ops through a StagePipeline with one host sink; returns (result, stats)."""
    arr = np.ascontiguousarray(np.array(ops, dtype=np.int64).reshape(-1, 9))
    sinks = np.zeros(len(arr), dtype=np.int64)
    p = C.StagePipeline(ring, ring_bytes, [{"kind": "host", **(sink or {})}])
    try:
        r = p.run([path], arr.ctypes.data, sinks.ctypes.data, len(arr), threads=2,
                  io="buffered", **kw)
    finally:
        p.close()
    assert p.closed
    return r, p.stats()[0]


def _op(off, row_bytes, rows, src_stride, dst, dst_stride):
    return [0, off, row_bytes, rows, src_stride, dst_stride, dst, RAW, RAW]


@pytest.fixture
def raw_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    p = tmp_path / "raw.bin"
    data.tofile(p)
    return str(p), data


def test_op_larger_than_a_buffer_is_cut_and_chunks_counted(raw_file, no_leaks):
    path, data = raw_file
    dst = np.zeros(300_000, dtype=np.uint8)
    # one contiguous op of 300,000 B through 4 KiB buffers: 74 pieces, 74 chunks
    r, st = _pipe_read(path, [_op(1000, 300_000, 1, 300_000, dst.ctypes.data, 300_000)], 2, 4096)
    assert r["ok"] and r["pieces"] == 74 and r["chunks"] == 74
    assert np.array_equal(dst, data[1000:301_000])
    assert st["copies"] == 74 and st["records"] == 74 and st["reuse_violations"] == 0
    assert st["began"] and st["finished"]
    # strided rows wider than a buffer: cut by row, then inside each row
    rows = np.zeros((5, 10_000), dtype=np.uint8)
    dst2 = np.zeros((5, 12_000), dtype=np.uint8)
    r, st = _pipe_read(path, [_op(7, 10_000, 5, 20_000, dst2.ctypes.data, 12_000)], 1, 4096)
    for i in range(5):
        rows[i] = data[7 + i * 20_000: 7 + i * 20_000 + 10_000]
    assert r["ok"] and np.array_equal(dst2[:, :10_000], rows)
    assert not dst2[:, 10_000:].any()
    assert r["pieces"] == 15


def test_chunks_pack_small_ops_and_reuse_waits(raw_file, no_leaks):
    path, data = raw_file
    dst = np.zeros(64 * 100, dtype=np.uint8)
    ops = [_op(i * 1000, 64, 1, 64, dst.ctypes.data + i * 64, 64) for i in range(100)]
    # 64 B ops, 64 B-aligned in 1 KiB buffers: 16 a chunk
    r, st = _pipe_read(path, ops, 2, 1024, sink={"delay_us": 100})
    assert r["ok"] and r["chunks"] == 7 and r["pieces"] == 100
    for i in range(100):
        assert np.array_equal(dst[i * 64:(i + 1) * 64], data[i * 1000:i * 1000 + 64])
    assert st["waits"] == 5 and st["reuse_violations"] == 0  # chunks 2..6 reuse a buffer


def test_two_sinks_route_ops_and_keep_their_own_events(raw_file, no_leaks):
    """Two destination "devices": each op goes to its own sink; a buffer is reused only when
    both sinks' copies out of it are done."""
    path, data = raw_file
    dst = np.zeros(64 * 60, dtype=np.uint8)
    ops = np.array([_op(i * 333, 64, 1, 64, dst.ctypes.data + i * 64, 64) for i in range(60)],
                   dtype=np.int64)
    sinks = np.array([i % 2 for i in range(60)], dtype=np.int64)
    p = C.StagePipeline(2, 256, [{"kind": "host", "delay_us": 80}, {"kind": "host"}])
    try:
        r = p.run([path], ops.ctypes.data, sinks.ctypes.data, len(ops), threads=2)
    finally:
        p.close()
    assert r["ok"] and r["chunks"] == 15
    for i in range(60):
        assert np.array_equal(dst[i * 64:(i + 1) * 64], data[i * 333:i * 333 + 64]), i
    a, b = p.stats()
    assert a["copies"] == b["copies"] == 30
    assert a["records"] == b["records"] == 15
    assert a["reuse_violations"] == b["reuse_violations"] == 0
    assert a["finished"] and b["finished"]


def test_io_error_mid_pipeline(raw_file, monkeypatch, no_leaks):
    path, data = raw_file
    dst = np.zeros(1 << 16, dtype=np.uint8)
    # chunk 0: one pread; chunk 1: 16 rows read one pread each (no coalescing): the 2nd fails
    ops = [_op(0, 512, 1, 512, dst.ctypes.data, 512),
           _op(4096, 64, 16, 8192, dst.ctypes.data + 4096, 64)]
    monkeypatch.setenv("METAMAT_IO_FAULT", "2:eio")
    r, st = _pipe_read(path, ops, 2, 1024, sink={"delay_us": 200}, coalesce_gap=-1)
    assert not r["ok"] and r["failed_op"] == 1 and r["chunks"] == 2
    assert "Input/output error" in r["error"] or "EIO" in r["error"] or "I/O" in r["error"]
    # chunk 0's copy was queued and drained by close()
    assert np.array_equal(dst[:512], data[:512]) and st["copies"] == 1 and st["finished"]


def test_copy_failure_mid_pipeline_raises_and_releases(raw_file, no_leaks):
    path, _ = raw_file
    dst = np.zeros(1 << 16, dtype=np.uint8)
    ops = [_op(i * 64, 64, 1, 64, dst.ctypes.data + i * 64, 64) for i in range(200)]
    with pytest.raises(RuntimeError, match="injected copy failure at copy 37"):
        _pipe_read(path, ops, 2, 256, sink={"fail_copy_at": 37, "delay_us": 20})


def test_bad_arguments_release_everything(raw_file, no_leaks):
    path, _ = raw_file
    with pytest.raises(RuntimeError, match="at least one buffer"):
        C.StagePipeline(0, 4096, [{"kind": "host"}])
    with pytest.raises(RuntimeError, match="at least 64 bytes"):
        C.StagePipeline(2, 8, [{"kind": "host"}])
    with pytest.raises(ValueError, match="sink kind"):
        C.StagePipeline(2, 4096, [{"kind": "tpu"}])
    p = C.StagePipeline(2, 4096, [{"kind": "host"}])
    arr = np.array([_op(0, 8, 1, 8, 0, 8)], dtype=np.int64)
    bad = np.array([3], dtype=np.int64)
    with pytest.raises(RuntimeError, match="sink index 3 out of range"):
        p.run([path], arr.ctypes.data, bad.ctypes.data, 1)
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.run([path], arr.ctypes.data, bad.ctypes.data, 1)
    # a pipeline dropped without close(): the destructor releases
    q = C.StagePipeline(3, 4096, [{"kind": "host"}, {"kind": "host"}])
    assert C.stage_live_buffers() >= 3 and C.stage_live_threads() >= 2
    del q


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure path")
def test_cuda_sink_without_a_gpu_fails_cleanly(no_leaks):
    if not C.cuda_compiled():
        match = "without its CUDA backend"
    else:
        match = "cuda"
    with pytest.raises(RuntimeError, match=f"(?i){match}"):
        C.StagePipeline(2, 4096, [{"kind": "host"}, {"kind": "cuda", "device": 0, "stream": 0}])


def test_checksum_mismatch_mid_pipeline(tmp_path, no_leaks):
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(4096, generator=g), "b": torch.randn(64, 64, generator=g)}
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    write_manifest(path, block_bytes=4096)
    ck = open_checkpoint(path)
    b_chunk = ck.tensors()["b"].chunks[0]
    with open(b_chunk.file, "r+b") as f:  # a byte of "b": read after "a"'s chunks
        f.seek(b_chunk.byte_offset + 5000)
        x = f.read(1)
        f.seek(b_chunk.byte_offset + 5000)
        f.write(bytes([x[0] ^ 1]))
    tg = [target("a", sd["a"], (0,), (4096,)), target("b", sd["b"], (0, 0), (64, 64))]
    with open_checkpoint(path) as ck:
        plan = plan_load(tg, ck)
        budget = StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16, ring=2, ring_bytes=4096)
        with pytest.raises(ChecksumMismatchError, match="'b'"):
            execute_plan_staged(plan, budget, verify=load_manifest(ck), io="buffered",
                                _host_sink={"delay_us": 100})
    # "a" went through before the mismatch
    assert same_bits(tg[0].tensor, sd["a"])


def test_read_error_mid_pipeline_names_the_tensor(tmp_path, monkeypatch, no_leaks):
    g = torch.Generator().manual_seed(4)
    sd = {"a": torch.randn(1024, generator=g), "b": torch.randn(64, 2048, generator=g)}
    path = str(tmp_path / "m.safetensors")
    save_file(sd, path)
    # chunk 0: "a" (4 KiB, one pread); chunk 1: 64 rows 8 KiB apart, one pread each
    tg = [target("a", sd["a"], (0,), (1024,)), target("b", sd["b"], (0, 1), (64, 3))]
    monkeypatch.setenv("METAMAT_IO_FAULT", "3:eio")
    with open_checkpoint(path) as ck:
        plan = plan_load(tg, ck)
        budget = StagingBudget(1 << 30, threads=1, bounce_bytes=1 << 16, ring=2, ring_bytes=4096)
        with pytest.raises(ReadError, match="'b'"):
            execute_plan_staged(plan, budget, io="buffered", _host_sink={"delay_us": 100})
    assert same_bits(tg[0].tensor, sd["a"])


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("convert_on", ["host", "device"])
def test_cuda_pinned_ring_equals_host(ckpt, no_leaks, monkeypatch, convert_on):
    """Random blocks (row-padded ones are strided destinations on the GPU too; fp32 read into
    fp16/bf16, converted by the readers or by the copy stream's kernel) equal the
    checkpoint; no padding written."""
    sd, path = ckpt
    monkeypatch.setenv("METAMAT_CONVERT_ON", convert_on)
    rng = random.Random(7)
    strided = 0
    for ring, ring_bytes in ((1, 64), (2, 4096), (3, 1 << 20)):
        tg = _random_targets(sd, rng, 5, convert=True)
        for t in tg:
            t.tensor = on_device(t.tensor, "cuda")
            strided += not t.tensor.is_contiguous()
        pads = [outside(t.tensor) for t in tg]
        with open_checkpoint(path) as ck:
            plan = plan_load(tg, ck)
            execute_plan_staged(plan, StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16, ring=ring,
                                                    ring_bytes=ring_bytes))
        for t, pad in zip(tg, pads):
            ref = expect(sd[t.fqn], t.offsets, t.local_shape).to(t.tensor.dtype)
            assert same_bits(t.tensor.cpu(), ref), t.fqn
            assert same_bits(outside(t.tensor), pad), f"{t.fqn}: padding written"
    assert strided, "no strided destination drawn"


@pytest.mark.cuda
def test_cuda_copies_ordered_after_and_before_the_callers_stream(ckpt):
    """The caller's stream is busy writing the destination (a long kernel, then a fill): the
    load's copies land after it, and work queued on the stream after the load sees them (the
    sink also waits for its copies before it returns)."""
    sd, path = ckpt
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = target("w", sd["w"], (0, 0), (300, 70))
        t.tensor = torch.empty(300, 70, device="cuda")
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time on s
        t.tensor.fill_(7.0)               # must not overwrite the loaded bytes
        assert not s.query(), "the stream finished before the load began: nothing was ordered"
        with open_checkpoint(path) as ck:
            execute_plan_staged(plan_load([t], ck),
                                StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16, ring=2,
                                              ring_bytes=4096))
        total = t.tensor.double().sum()  # queued on s after the load, no host sync
    s.synchronize()
    assert same_bits(t.tensor.cpu(), sd["w"])
    assert torch.isclose(total.cpu(), sd["w"].double().sum())


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_destination_on_a_non_current_device(ckpt):
    sd, path = ckpt
    torch.cuda.set_device(0)
    t = target("w", sd["w"], (3, 2), (100, 50), row_pad=5)
    t.tensor = torch.full((100, 55), float("nan"), device="cuda:1")[:, :50]
    with open_checkpoint(path) as ck:
        execute_plan_staged(plan_load([t], ck),
                            StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16, ring=2,
                                          ring_bytes=4096))
    assert torch.cuda.current_device() == 0  # the device guard restored it
    torch.cuda.synchronize(1)
    assert same_bits(t.tensor.cpu(), expect(sd["w"], (3, 2), (100, 50)))
