"""Faults in the C++ reader: injected I/O errors and short reads (METAMAT_IO_FAULT), and files
truncated between planning and reading. The load must raise ReadError naming the file, join
every reader thread and close every descriptor; retried faults must not change the values."""
from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import save_file

from metamat.checkpoint import CheckpointError, ReadError, TruncatedFileError, open_checkpoint
from metamat.load import load_targets, plan_load
from metamat.load.execute import execute_plan
from metamat.budget import StagingBudget
from metamat.plan import Target

POISON = 0xA5


@pytest.fixture
def fault(monkeypatch):
    """Set METAMAT_IO_FAULT for the test (the C++ reader reads it at each call)."""
    def set_(spec: str) -> None:
        monkeypatch.setenv("METAMAT_IO_FAULT", spec)
    yield set_
    monkeypatch.delenv("METAMAT_IO_FAULT", raising=False)


def _state():
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(600, 700, generator=g), "vec": torch.randn(5000, generator=g)}


@pytest.fixture
def ckpt_path(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(_state(), str(p))
    return str(p)


def _targets():
    """Whole tensors, a column slice (strided rows), and a bf16 conversion: many preads."""
    out = []
    for fqn, shape, offs, local, dtype in [
            ("big", (600, 700), (0, 0), (600, 700), torch.float32),
            ("big", (600, 700), (10, 100), (500, 300), torch.float32),
            ("big", (600, 700), (0, 0), (600, 700), torch.bfloat16),
            ("vec", (5000,), (0,), (5000,), torch.float32)]:
        t = torch.empty(local, dtype=dtype)
        t.view(torch.uint8).fill_(POISON)
        out.append(Target(fqn, fqn, shape, offs, local, dtype, tensor=t))
    return out


def _untouched(targets) -> bool:
    return all(bool((t.tensor.view(torch.uint8) == POISON).all()) for t in targets)


def _expected(t: Target) -> torch.Tensor:
    full = _state()[t.fqn]
    idx = tuple(slice(o, o + s) for o, s in zip(t.offsets, t.local_shape))
    return full[idx].to(t.dtype)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _tasks_back_to(n: int, timeout: float = 2.0) -> bool:
    """True once the thread count is ``n`` again. A joined thread can stay listed in
    /proc/self/task for a moment after pthread_join returns (the kernel reaps it just
    after waking the joiner); a leaked thread stays for good."""
    end = time.monotonic() + timeout
    while _tasks() != n:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _warm(reader, ckpt_path):
    # a first good load starts whatever threads torch/numpy keep, so counts are stable after
    load_targets(_targets(), open_checkpoint(ckpt_path), io_threads=4)


@pytest.mark.parametrize("mode", ["eio", "eof"])
@pytest.mark.parametrize("nth", [1, 2, 5, 11])
def test_injected_error_raises_read_error_and_joins(reader, ckpt_path, fault, mode, nth):
    _warm(reader, ckpt_path)
    ck = open_checkpoint(ckpt_path)
    tasks, fds = _tasks(), _fds()
    fault(f"{nth}:{mode}")
    with pytest.raises(ReadError) as ei:
        load_targets(_targets(), ck, io_threads=4, staging_bytes=4 << 20, io="buffered")
    msg = str(ei.value)
    assert ckpt_path in msg, msg
    assert ("Input/output error" if mode == "eio" else "unexpected end of file") in msg, msg
    assert ei.value.tensor in ("big", "vec"), msg
    assert _tasks_back_to(tasks), "a reader thread outlived the call"
    assert _fds() == fds, "a file descriptor leaked"


@pytest.mark.parametrize("mode", ["short", "eintr"])
@pytest.mark.parametrize("nth", [1, 3, 25])
def test_retried_faults_give_exact_values(reader, ckpt_path, fault, mode, nth):
    ck = open_checkpoint(ckpt_path)
    fault(f"{nth}:{mode}")
    targets = _targets()
    load_targets(targets, ck, io_threads=4, staging_bytes=4 << 20)
    for t in targets:
        assert torch.equal(t.tensor, _expected(t)), (t.fqn, t.offsets, t.dtype)


@pytest.mark.parametrize("spec", ["", "0:eio", "x:eio", "3:nonsense", "-1:eof"])
def test_malformed_fault_spec_is_ignored(reader, ckpt_path, fault, spec):
    fault(spec)
    targets = _targets()
    load_targets(targets, open_checkpoint(ckpt_path), io_threads=2)
    assert all(torch.equal(t.tensor, _expected(t)) for t in targets)


def test_truncated_between_plan_and_read(reader, ckpt_path):
    """The C++ reader re-validates byte ranges against fstat before writing anything."""
    _warm(reader, ckpt_path)
    ck = open_checkpoint(ckpt_path)
    targets = _targets()
    plan = plan_load(targets, ck)
    os.truncate(ckpt_path, os.path.getsize(ckpt_path) - 1000)
    tasks, fds = _tasks(), _fds()
    # the identity recorded at open_checkpoint (size, mtime) refuses the file first ...
    with pytest.raises(ReadError) as ei:
        execute_plan(plan, StagingBudget.split(256 << 20, 4, staged=False))
    assert ckpt_path in str(ei.value) and "changed since the checkpoint was opened" in str(
        ei.value)
    assert _untouched(targets), "validation failed after a destination was written"
    # ... and without identities, the byte ranges are checked against fstat
    plan.identities = [(-1, -1, -1, -1)] * len(plan.files)
    with pytest.raises(ReadError) as ei:
        execute_plan(plan, StagingBudget.split(256 << 20, 4, staged=False))
    assert ckpt_path in str(ei.value) and "past end of file" in str(ei.value)
    assert _untouched(targets), "validation failed after a destination was written"
    assert _tasks_back_to(tasks) and _fds() == fds
    # through load_targets the planner's re-stat catches it first, also before any write
    with pytest.raises(TruncatedFileError):
        load_targets(targets, ck)
    assert _untouched(targets)


def test_file_replaced_between_plan_and_read(reader, ckpt_path):
    ck = open_checkpoint(ckpt_path)
    targets = _targets()
    plan = plan_load(targets, ck)
    os.remove(ckpt_path)
    with pytest.raises(ReadError) as ei:
        execute_plan(plan, StagingBudget.split(256 << 20, 2, staged=False))
    assert "cannot open" in str(ei.value) and ckpt_path in str(ei.value)
    assert _untouched(targets)


def test_repeated_failures_do_not_leak(reader, ckpt_path, fault):
    import psutil
    _warm(reader, ckpt_path)
    ck = open_checkpoint(ckpt_path)
    tasks, fds = _tasks(), _fds()
    proc = psutil.Process()
    rss0 = None
    for i in range(60):
        fault(f"{1 + i % 9}:{'eio' if i % 2 else 'eof'}")
        with pytest.raises(CheckpointError):
            load_targets(_targets(), ck, io_threads=4, staging_bytes=8 << 20, io="buffered")
        if i == 9:
            rss0 = proc.memory_info().rss
    assert _tasks_back_to(tasks) and _fds() == fds
    # 50 failed loads of ~5 MB each; bounce buffers (8 MiB per thread) must be freed
    assert proc.memory_info().rss - rss0 < 64 << 20
