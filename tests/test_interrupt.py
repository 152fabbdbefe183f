"""Ctrl-C during a long load: KeyboardInterrupt reaches the caller, no reader thread is left
running, and a meta model is still entirely on meta (nothing half swapped in).

The C++ reader releases the GIL and joins its pool before returning, and ``execute_plan``
runs the reads in batches (``metamat.load.ops.BATCH_BYTES``), so Python raises KeyboardInterrupt
when the batch in flight returns. The signal is sent by a helper thread once the reader's
pool threads are seen in ``/proc/self/task`` (so it lands while C++ is reading).
"""
from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import pytest
import torch
from torch import nn

import metamat
from metamat.checkpoint import open_checkpoint
from metamat.load import load_targets
from metamat.collective import defer_sigint
from metamat.plan import Target

ROWS, DIM = 600_000, 128  # 307 MB of float32


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 4)


def _meta_model() -> Big:
    with torch.device("meta"):
        return Big()


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory):
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("big") / "big.safetensors")
    save_file({"emb.weight": torch.ones(ROWS, DIM), "head.weight": torch.ones(4, DIM),
               "head.bias": torch.ones(4)}, path)
    return path


@pytest.fixture
def sigint_default():
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _interrupt_when_reading(baseline: int, stop: threading.Event, sent: list):
    """Send SIGINT to this process as soon as reader threads exist beyond ``baseline``
    (+1 for this helper thread), unless ``stop`` is set first."""
    while not stop.is_set():
        if _tasks() > baseline + 1:
            sent.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)
            return
        time.sleep(0.0002)


def _run_interrupted(fn):
    """Run ``fn`` with the helper armed; returns (KeyboardInterrupt or None, traceback text)."""
    baseline = _tasks()
    stop, sent = threading.Event(), []
    helper = threading.Thread(target=_interrupt_when_reading, args=(baseline, stop, sent))
    caught, tb = None, ""
    helper.start()
    try:
        try:
            fn()
        finally:
            stop.set()
            helper.join()
        time.sleep(0.2)  # a late signal would land here (and fail the test below)
    except KeyboardInterrupt as e:
        caught, tb = e, traceback.format_exc()
    helper.join()
    return caught, tb, sent


def _wait_for(pred, timeout=2.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def _warm_up(path):
    """Start torch's own worker threads (intra-op pool) so the baseline includes them."""
    m = _meta_model()
    metamat.materialize(m, path, device="cpu", io_threads=2, progress=False)
    torch.ones(1000).add_(1)


@pytest.mark.parametrize("verify", [False, True])
def test_sigint_during_materialize(big_ckpt, sigint_default, verify):
    if verify:
        from metamat.checkpoint.checksum import sidecar_path, write_manifest
        if not os.path.exists(sidecar_path(big_ckpt)):
            write_manifest(big_ckpt)
    _warm_up(big_ckpt)
    base_tasks, base_threads = _tasks(), threading.active_count()
    model = _meta_model()
    caught, tb, sent = _run_interrupted(
        lambda: metamat.materialize(model, big_ckpt, device="cpu", io_threads=2,
                                    progress=False, verify=verify))
    assert sent, "the load finished before any reader thread was seen"
    assert isinstance(caught, KeyboardInterrupt)
    assert "execute_plan" in tb, tb  # raised inside the load, between batches
    assert _wait_for(lambda: _tasks() == base_tasks), (_tasks(), base_tasks)
    assert threading.active_count() == base_threads
    assert all(p.is_meta for p in model.parameters())
    # the same model loads normally afterwards
    metamat.materialize(model, big_ckpt, device="cpu", io_threads=2, progress=False,
                        verify=verify)
    assert not any(p.is_meta for p in model.parameters())
    assert torch.equal(model.emb.weight[-1], torch.ones(DIM))


def test_sigint_during_load_targets(big_ckpt, sigint_default):
    _warm_up(big_ckpt)
    base_tasks, base_threads = _tasks(), threading.active_count()
    ck = open_checkpoint(big_ckpt)
    t = Target("emb.weight", "emb.weight", (ROWS, DIM), (0, 0), (ROWS, DIM), torch.float32,
               tensor=torch.zeros(ROWS, DIM))
    caught, tb, sent = _run_interrupted(lambda: load_targets([t], ck, io_threads=2))
    assert sent and isinstance(caught, KeyboardInterrupt)
    assert "execute_plan" in tb, tb
    # it stopped after the batch in flight: the last rows (ones in the file) were never read
    assert t.tensor[0].eq(1).all() and t.tensor[-1].eq(0).all()
    assert _wait_for(lambda: _tasks() == base_tasks), (_tasks(), base_tasks)
    assert threading.active_count() == base_threads


def test_sigint_held_while_swapping(sigint_default):
    """A SIGINT arriving while tensors are swapped in is raised once the swap is done."""
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with defer_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            steps.append("after the signal")
    assert steps == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
