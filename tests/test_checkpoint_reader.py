"""The C++ reader (metamat._C.read_ops / convert) against torch and against bad plans."""
from __future__ import annotations

import numpy as np
import pytest
import torch

F32, F16, BF16 = 1, 2, 3
CODES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}


@pytest.fixture(scope="module")
def C():
    from metamat._ext import ExtensionNotBuiltError, core
    try:
        mod = core()
    except ExtensionNotBuiltError as e:
        pytest.skip(f"metamat._C not built: {e}")
    assert hasattr(mod, "read_ops"), "metamat._C was built without the io reader"
    return mod


def _convert(C, src: torch.Tensor, dst_dtype) -> torch.Tensor:
    out = torch.empty(src.shape, dtype=dst_dtype)
    C.convert(src.data_ptr(), CODES[src.dtype], out.data_ptr(), CODES[dst_dtype], src.numel())
    return out


def _same(a, b):
    """Bit-equal, except NaNs only need to be NaN on both sides."""
    nan = torch.isnan(a.float())
    assert torch.equal(nan, torch.isnan(b.float()))
    ka = a[~nan].contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32)
    kb = b[~nan].contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32)
    assert torch.equal(ka, kb)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_convert_every_half_pattern(C, half):
    allbits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(half)
    _same(_convert(C, allbits, torch.float32), allbits.float())
    other = torch.bfloat16 if half == torch.float16 else torch.float16
    _same(_convert(C, allbits, other), allbits.float().to(other))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_convert_fp32_patterns_round_to_nearest_even(C, half):
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 20,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    # plus every rounding tie and boundary around the half grid
    ties = (torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(half)
            .float())
    ties = ties[torch.isfinite(ties)]
    nxt = torch.nextafter(ties, torch.full_like(ties, float("inf")))
    mid = ((ties.double() + nxt.double()) / 2).float()
    x = torch.cat([x, ties, mid, torch.nextafter(mid, ties), torch.nextafter(mid, nxt),
                   torch.tensor([65504.0, 65519.99, 65520.0, 1e-8, 6e-8, -0.0, float("inf")])])
    _same(_convert(C, x, half), x.to(half))


def _ops(*rows):
    return np.array(rows, dtype=np.int64).reshape(-1, 9)


def test_reader_validates_before_writing(C, tmp_path):
    p = tmp_path / "d.bin"
    p.write_bytes(bytes(range(256)) * 4)
    dst = torch.full((1024,), 7, dtype=torch.uint8)
    a = dst.data_ptr()
    good = (0, 0, 100, 1, 0, 0, a, 0, 0)
    cases = {
        "past end of file": (0, 1000, 100, 1, 0, 0, a, 0, 0),
        "file index": (1, 0, 10, 1, 0, 0, a, 0, 0),
        "overlap": (0, 0, 10, 3, 5, 10, a, 0, 0),
        "unsupported conversion": (0, 0, 8, 1, 0, 0, a, 0, 3),
        "null destination": (0, 0, 8, 1, 0, 0, 0, 0, 0),
    }
    for msg, bad in cases.items():
        arr = _ops(good, bad)
        ok, err, failed, nread, wrote = C.read_ops([str(p)], arr.ctypes.data, 2, 2)
        assert not ok and not wrote and failed == 1 and msg in err, (msg, err)
        assert "read op 1" in err
        assert (dst == 7).all()
    arr = _ops(good)
    ok, err, failed, nread, wrote = C.read_ops([str(tmp_path / "nope.bin")], arr.ctypes.data,
                                               1, 2)
    assert not ok and "nope.bin" in err and "cannot open" in err


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("task_bytes,bounce,gap", [(4096, 64, 4096), (1 << 20, 1 << 20, -1),
                                                  (4096, 4096, 0)])
def test_reader_strided_and_split(C, tmp_path, threads, task_bytes, bounce, gap):
    src = torch.randn(1001, 77)
    p = tmp_path / "s.bin"
    p.write_bytes(b"\1" * 5 + src.numpy().tobytes())
    out32 = torch.full((999, 40), float("nan"))
    outbf = torch.full((1001 * 77,), float("nan"), dtype=torch.bfloat16)
    arr = _ops(
        # rows 1..999, cols 30..69, into a contiguous (999, 40) buffer
        (0, 5 + (77 + 30) * 4, 40 * 4, 999, 77 * 4, 40 * 4, out32.data_ptr(), 0, 0),
        # the whole thing, converted to bf16, as one run (split into tasks)
        (0, 5, 1001 * 77 * 4, 1, 0, 0, outbf.data_ptr(), F32, BF16),
    )
    ok, err, failed, nread, wrote = C.read_ops([str(p)], arr.ctypes.data, 2, threads,
                                               task_bytes, bounce, gap)
    assert ok, err
    assert torch.equal(out32, src[1:1000, 30:70])
    assert torch.equal(outbf.view(torch.int16), src.reshape(-1).bfloat16().view(torch.int16))
    assert nread >= 999 * 40 * 4 + 1001 * 77 * 4
