"""Device-side dtype conversion of staged loads (METAMAT_CONVERT_ON=device): the readers stage
fp32 rows raw and the sink converts them after the copy (CUDA: a kernel on the copy stream; the
host sink, here, runs the kernel's per-element function, csrc/stage/convert_elem.h). The per-element
function equals the reader's host conversion on every fp32 bit pattern, and device-converted
loads equal host-converted ones bit for bit, through rings of every shape."""
from __future__ import annotations

import random

import pytest
import torch

from metamat._ext import core
from metamat.checkpoint import open_checkpoint
from metamat.load import plan_load
from metamat.budget import StagingBudget
from metamat.load.staged import execute_plan_staged
from test_load import same_bits, target
from test_stage_pipeline import _random_targets, ckpt, no_leaks  # noqa: F401 (fixtures)

C = core()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_per_element_function_equals_host_conversion_on_every_float(dtype):
    r = C.convert_elem_check(C.DTYPE_CODES[dtype], 1)
    assert r["checked"] == 2**32
    assert r["mismatches"] == 0, hex(r["first_input"])


def _load(path, tg, ring, ring_bytes, mode, monkeypatch):
    monkeypatch.setenv("METAMAT_CONVERT_ON", mode)
    with open_checkpoint(path) as ck:
        plan = plan_load(tg, ck)
        budget = StagingBudget(1 << 30, threads=2, bounce_bytes=1 << 16, ring=ring,
                               ring_bytes=ring_bytes)
        return execute_plan_staged(plan, budget, io="buffered")


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("ring_bytes", [64, 4096, 100_000, 1 << 22])
def test_device_conversion_equals_host_conversion(ckpt, no_leaks, monkeypatch, ring, ring_bytes):
    # random blocks of fp32 tensors into fp32/fp16/bf16 targets, strided and contiguous; rows
    # wider than a buffer stay on the host path (the readers cut them inside the row)
    sd, path = ckpt
    rng = random.Random(ring * 7 + ring_bytes)
    for _ in range(3):
        tg = _random_targets(sd, rng, rng.randint(1, 6), convert=True)
        twin = [target(t.fqn, sd[t.fqn], t.offsets, t.local_shape, t.tensor.dtype,
                       row_pad=(t.tensor.stride(0) - t.local_shape[1])
                       if t.tensor.dim() == 2 else 0) for t in tg]
        _load(path, tg, ring, ring_bytes, "device", monkeypatch)
        _load(path, twin, ring, ring_bytes, "host", monkeypatch)
        for a, b in zip(tg, twin):
            assert same_bits(a.tensor, b.tensor), (a.fqn, a.tensor.dtype)


def test_device_conversion_stages_fp32_bytes(ckpt, no_leaks, monkeypatch):
    # the sink copies fp32 (the PCIe bytes double) and converts; the host path copies bf16
    sd, path = ckpt
    rows = sd["w"].shape[0]
    mk = lambda: [target("w", sd["w"], (0, 0), (rows, 70), torch.bfloat16)]  # noqa: E731
    for mode, per_elem in (("device", 4), ("host", 2)):
        monkeypatch.setenv("METAMAT_CONVERT_ON", mode)
        tg = mk()
        with open_checkpoint(path) as ck:
            plan = plan_load(tg, ck)
            pipe = C.StagePipeline(2, 1 << 20, [{"kind": "host"}])
            try:
                import numpy as np
                from metamat.load.ops import op_array
                arr = op_array(plan.ops, [tg[0].tensor.data_ptr()])
                sinks = np.zeros(len(arr), dtype=np.int64)
                r = pipe.run(list(plan.files), arr.ctypes.data, sinks.ctypes.data, len(arr),
                             threads=2, io="buffered")
            finally:
                pipe.close()
        assert r["ok"]
        assert pipe.stats()[0]["bytes"] == rows * 70 * per_elem, mode
        assert torch.equal(tg[0].tensor, sd["w"].to(torch.bfloat16))


def test_bad_setting_is_an_error(ckpt, no_leaks, monkeypatch):
    sd, path = ckpt
    tg = [target("w", sd["w"], (0, 0), (4, 70), torch.bfloat16)]
    with pytest.raises(RuntimeError, match="METAMAT_CONVERT_ON"):
        _load(path, tg, 2, 4096, "gpu", monkeypatch)
