"""The row-wise quantizer (csrc/quant_rowwise, ``_C.quantize_rows``) against its NumPy
reference (metamat/load/quantize.py) and against fbgemm's own op
(``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``, what TorchRec's quantization calls), at
sizes that straddle the kernel's vector widths (8 and 32 elements), 1-row inputs, odd
dimensions, and the rows that decide edge cases (constant rows, signed zeros, tiny and huge
ranges). Destinations are poisoned first so an unwritten or overwritten byte shows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from metamat._ext import core
from metamat.load.quantize import (QuantJob, QuantOut, quantize_into, quantize_reference,
                                   unpadded_row_bytes)

ISAS = ["scalar"] + (["avx2"] if core().quant_isa() == "avx2" else [])
POISON = 0xAB


def fbgemm_rows(x: torch.Tensor, bits: int) -> np.ndarray:
    """fbgemm's op, reordered to the TBE's layout (scale/bias first). The sign of a zero bias
    is fbgemm 1.9's (the row's first zero: the first of equal minima) on every version: 1.8's
    op folded 8 lanes, so a row whose minimum is a zero of both signs got another sign there
    (the same dequantized values)."""
    fbgemm_gpu = pytest.importorskip("fbgemm_gpu")
    out = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, bits).numpy()
    nb = x.shape[1] * bits // 8
    rows = np.concatenate([out[:, nb:], out[:, :nb]], axis=1)
    if tuple(int(v) for v in fbgemm_gpu.__version__.split(".")[:2]) < (1, 9):
        for r, v in enumerate(x.float().numpy()):
            bias = rows[r, 2:4].view(np.uint16)
            if bias[0] & 0x7FFF == 0 and (v == 0).any():
                bias[0] = 0x8000 if np.signbit(v[np.flatnonzero(v == 0)[0]]) else 0
    return rows


def edge_rows(cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, cols, generator=g)
    x[1] = 1.5  # constant: range 0
    x[2] = 0.0
    x[2, cols // 2] = -0.0  # a zero minimum of both signs: fbgemm's reduction order decides
    x[3] *= 1e-6  # scale below fp16's normal range
    x[4] *= 1e4  # large range
    x[5, 0] = -3.0  # the minimum in the tail / first lane
    x[6, -1] = 7.0
    x[7] = torch.arange(cols, dtype=torch.float32) - cols / 2  # rounding ties
    x[8] *= 0.0
    return x


def core_rows(x: torch.Tensor, kind: int, isa: str, *, sb_last: bool = False,
              col0: int = 0, cols=None, pad: int = 3, threads: int = 1) -> np.ndarray:
    """Quantize ``x`` with the core into poisoned rows padded by ``pad`` bytes; checks the
    padding is untouched and returns the unpadded rows."""
    cols = x.shape[1] - col0 if cols is None else cols
    nb = unpadded_row_bytes(kind, cols)
    buf = torch.full((x.shape[0], nb + pad), POISON, dtype=torch.uint8)
    arr = np.array([[col0, cols, buf.data_ptr(), nb + pad, kind, int(sb_last)]], dtype=np.int64)
    core().quantize_rows(x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], arr.ctypes.data, 1,
                         threads, isa)
    assert (buf[:, nb:] == POISON).all(), "padding written"
    return buf[:, :nb].numpy()


INT_COLS = {8: [2, 8, 16, 24, 30, 32, 34, 64, 96, 130],  # (cols + 4) even: fbgemm's op
            4: [4, 8, 28, 32, 36, 64, 68, 128],
            2: [8, 16, 24, 32, 40, 64, 128]}


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_reference_is_fbgemm(bits):
    for cols in INT_COLS[bits]:
        x = edge_rows(cols, cols)
        assert np.array_equal(quantize_reference(x.numpy(), bits), fbgemm_rows(x, bits)), cols


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_core_is_fbgemm_and_reference(isa, bits):
    for cols in INT_COLS[bits]:
        x = edge_rows(cols, 100 + cols)
        got = core_rows(x, bits, isa)
        assert np.array_equal(got, fbgemm_rows(x, bits)), cols
        assert np.array_equal(got, quantize_reference(x.numpy(), bits)), cols
    one = torch.randn(1, 32)  # a 1-row table
    assert np.array_equal(core_rows(one, bits, isa), fbgemm_rows(one, bits))


@pytest.mark.parametrize("isa", ISAS)
def test_int8_odd_dims_match_fbgemm(isa):
    """fbgemm's op refuses odd INT8 rows (its scale/bias must be 2-byte aligned) though the TBE
    holds them; a row padded with a copy of its own first element has the same min/max, so
    its first ``cols`` bytes and scale/bias are what the op computes for the odd row."""
    for cols in (1, 3, 7, 9, 31, 33, 63, 65):
        x = edge_rows(cols, cols)
        got = core_rows(x, 8, isa)
        ref = fbgemm_rows(torch.cat([x, x[:, :1]], dim=1), 8)
        assert np.array_equal(got[:, :4], ref[:, :4]), cols
        assert np.array_equal(got[:, 4:], ref[:, 4:4 + cols]), cols
        assert np.array_equal(got, quantize_reference(x.numpy(), 8)), cols


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind,dtype", [(16, torch.float16), (32, torch.float32)])
def test_float_kinds(isa, kind, dtype):
    for cols in (1, 7, 8, 9, 33):
        x = edge_rows(cols, cols)
        x[0, 0] = 65519.0  # rounds to fp16's max, 65520 to inf (round to nearest even)
        got = core_rows(x, kind, isa)
        want = x.to(dtype).view(torch.uint8).numpy()
        assert np.array_equal(got, want), cols
        assert np.array_equal(got, quantize_reference(x.numpy(), kind)), cols


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_column_slices_take_the_rows_scale_and_bias(isa, bits):
    """A column-wise shard: its columns of the whole row's quantization, the row's
    scale/bias (TorchRec's CW quant sharding)."""
    cols = 64
    x = edge_rows(cols, 7)
    full = core_rows(x, bits, isa)
    for col0, n in ((0, 32), (32, 32), (8, 16), (40, 24)):
        part = core_rows(x, bits, isa, col0=col0, cols=n)
        assert np.array_equal(part[:, :4], full[:, :4])
        b0, nb = col0 * bits // 8, n * bits // 8
        assert np.array_equal(part[:, 4:], full[:, 4 + b0:4 + b0 + nb])


@pytest.mark.parametrize("isa", ISAS)
def test_scale_bias_last(isa):
    x = edge_rows(24, 3)
    first = core_rows(x, 8, isa)
    last = core_rows(x, 8, isa, sb_last=True)
    assert np.array_equal(last, np.concatenate([first[:, 4:], first[:, :4]], axis=1))
    assert np.array_equal(last, quantize_reference(x.numpy(), 8, sb_last=True))


def test_threads_give_the_same_bytes():
    x = torch.randn(3001, 96)
    one = core_rows(x, 4, "", threads=1)
    assert np.array_equal(core_rows(x, 4, "", threads=4), one)


def test_fp16_input_is_fbgemm():
    """TorchRec quantizes fp16 tables from fp16; the reader stages them as fp32 (exact)."""
    x = torch.randn(17, 40).half()
    got = core_rows(x.float(), 8, "")
    out = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(x, 8).numpy()
    assert np.array_equal(got, np.concatenate([out[:, 40:], out[:, :40]], axis=1))


def _out(buf, col0, cols, kind, stride=None):
    return [col0, cols, buf.data_ptr(), stride or buf.shape[1], kind, 0]


@pytest.mark.parametrize("row,msg", [
    (lambda b: _out(b, 1, 8, 4), "whole bytes"),
    (lambda b: _out(b, 0, 6, 2), "whole bytes"),
    (lambda b: _out(b, 0, 70, 8), "outside"),
    (lambda b: _out(b, 0, 8, 5), "kind"),
    (lambda b: _out(b, 0, 64, 8, stride=8), "overlap"),
    (lambda b: [0, 8, 0, 64, 8, 0], "null"),
])
def test_bad_destinations_raise_and_write_nothing(row, msg):
    x = torch.randn(4, 64)
    buf = torch.full((4, 80), POISON, dtype=torch.uint8)
    arr = np.array([row(buf)], dtype=np.int64)
    with pytest.raises(RuntimeError, match=msg):
        core().quantize_rows(x.data_ptr(), 4, 64, 64, arr.ctypes.data, 1, 1, "")
    assert (buf == POISON).all()


def test_quantize_into_a_job_with_two_shards():
    """The Python seam: one job, two column-wise destinations in one storage, rows offset."""
    x = torch.randn(10, 16)
    store = torch.full((4096,), POISON, dtype=torch.uint8)
    outs = [QuantOut(0, 8, 8, 0, 128, 16), QuantOut(8, 8, 8, 0, 1024, 13)]
    for o in outs:
        o.base = store
    job = QuantJob("t.weight", "t", (10, 16), 0, 10, outs)
    quantize_into(x[:4], job, 0)
    quantize_into(x[4:], job, 4)
    full = quantize_reference(x.numpy(), 8)
    a = store[128:128 + 10 * 16].view(10, 16)[:, :12].numpy()
    b = np.stack([store[1024 + 13 * r:1024 + 13 * r + 12].numpy() for r in range(10)])
    assert np.array_equal(a[:, :4], full[:, :4]) and np.array_equal(a[:, 4:], full[:, 4:12])
    assert np.array_equal(b[:, :4], full[:, :4]) and np.array_equal(b[:, 4:], full[:, 12:20])
    with pytest.raises(ValueError, match="outside"):
        quantize_into(x[:4], job, 8)
