"""The CPU kernels' SIMD transforms (csrc/fill/simd_math.h) equal the scalar ones
(csrc/include/metamat/philox.h, csrc/include/metamat/dtype.h) bit for bit, for every instruction set
this CPU runs.

`_C.cpu_math(fn, isa, in, out, n)` runs one transform of one kernel, or "scalar" for the
functions every backend must equal. Box-Muller's two inputs have 2^24 values each (the top 24
bits of a word), so those are checked exhaustively; log and erfinv on edge cases (denormals,
the mantissa switch at sqrt(1/2), erfinv near +-1 and across its w = 5 branch) and random bits.
"""
import numpy as np
import pytest

from metamat import reference
from metamat._ext import core

ISAS = ["avx512", "avx2", "x86-64"]
F32 = np.float32
U32 = np.uint32


def _isa_or_skip(isa):
    if isa not in core().cpu_kernels():
        pytest.skip(f"this CPU cannot run the {isa} kernel")
    return isa


def run(fn, isa, inp, out_per_in=1, out_dtype=np.float32):
    """cpu_math over `inp` (uint32 bits); output poisoned first, with a guard tail."""
    inp = np.ascontiguousarray(inp).view(U32)
    n = inp.size // (2 if fn == "box_muller" else 1)
    out = np.full(n * out_per_in + 16, 0xA5A5, dtype=out_dtype if out_dtype == np.uint16 else U32)
    core().cpu_math(fn, isa, inp.ctypes.data, out.ctypes.data, n)
    assert (out[n * out_per_in:] == out[-1]).all(), "wrote past the end"
    out = out[: n * out_per_in]
    return out if out_dtype == np.uint16 else out.view(F32)


def assert_same_bits(got, want, what):
    g, w = np.asarray(got).view(U32), np.asarray(want).view(U32)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, f"{what}: {bad.size} differ, at {bad[:5]}: {g[bad[:5]]} vs {w[bad[:5]]}"


def assert_same_or_both_nan(got, want, what):
    """Bit-equal, except that any NaN equals any NaN (payloads of NaN inputs may differ)."""
    got, want = np.asarray(got), np.asarray(want)
    both_nan = np.isnan(got) & np.isnan(want)
    assert_same_bits(np.where(both_nan, F32(0), got), np.where(both_nan, F32(0), want), what)


def floats_near(x, ulps):
    """The float32 values within `ulps` ulps of each of x (same sign side)."""
    b = np.asarray(x, dtype=F32).view(np.int32).astype(np.int64)
    d = np.arange(-ulps, ulps + 1)
    return (b[:, None] + d[None, :]).ravel().astype(np.int32).view(F32)


RNG = np.random.default_rng(20240615)


def log_inputs():
    tiny = np.arange(0, 2048, dtype=U32).view(F32)  # +0 and the smallest denormals
    edges = np.array([1.17549435e-38, 1.0, 0.5, 2.0, 0.70710678, 1.41421356, 3.4e38, 1e-30,
                      np.inf, -1.0, -0.0, -1e-40, np.nan], dtype=F32)
    near = floats_near(edges[np.isfinite(edges) & (edges > 0)], 300)
    # Every mantissa around the m < sqrt(1/2) switch, at a few exponents.
    sw = floats_near(np.array([0.70710678, 1.41421356, 0.35355339, 181.019336], dtype=F32), 3000)
    big_denormals = (np.uint32(0x007FFFFF) - np.arange(2048, dtype=U32)).view(F32)
    rnd = RNG.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(U32).view(F32)
    return np.concatenate([tiny, big_denormals, edges, near, sw, rnd]).astype(F32)


@pytest.mark.parametrize("isa", ISAS)
def test_log(isa):
    x = log_inputs()
    got = run("log", _isa_or_skip(isa), x)
    want = run("log", "scalar", x)
    assert_same_or_both_nan(got, want, "log")
    pos = np.isfinite(x) & (x > 0)
    with np.errstate(all="ignore"):
        assert_same_bits(got[pos], reference.mm_logf(x[pos]), "log vs NumPy reference")
    assert np.all(got[x < F32(1.17549435e-38)] == -np.inf)


@pytest.mark.parametrize("isa", ISAS)
def test_sincos_every_angle(isa):
    """All 2^24 angles k (word bits 8..31), with random low bits that must not matter."""
    k = np.arange(1 << 24, dtype=U32)
    w = (k << U32(8)) | RNG.integers(0, 256, size=k.size, dtype=U32)
    got = run("sincos", _isa_or_skip(isa), w, out_per_in=2)
    assert_same_bits(got, run("sincos", "scalar", w, out_per_in=2), "sincos")
    # The scalar itself against the NumPy reference on quadrant boundaries and a sample.
    q = np.arange(5, dtype=np.int64) << 22
    edge = (q[:, None] + np.arange(-(1 << 21) - 40, -(1 << 21) + 40)[None, :]).ravel()
    edge = np.concatenate([edge, (q[:, None] + np.arange(-40, 40)[None, :]).ravel()])
    kk = np.concatenate([edge[(edge >= 0) & (edge < (1 << 24))].astype(U32), k[::101]])
    s, c = reference.mm_sincos_turns(kk)
    sc = run("sincos", isa, kk << U32(8), out_per_in=2)
    assert_same_bits(sc[0::2], s, "sin vs NumPy reference")
    assert_same_bits(sc[1::2], c, "cos vs NumPy reference")


@pytest.mark.parametrize("isa", ISAS)
def test_box_muller_every_radius_and_angle(isa):
    """All 2^24 radius words (the log's whole input domain), each paired with a different one
    of all 2^24 angles (box_muller has its own copy of the sin/cos steps), random low bits."""
    w0 = (np.arange(1 << 24, dtype=U32) << U32(8)) | RNG.integers(0, 256, 1 << 24, dtype=U32)
    w1 = (RNG.permutation(1 << 24).astype(U32) << U32(8)) | RNG.integers(0, 256, 1 << 24, dtype=U32)
    pairs = np.stack([w0, w1], axis=1).ravel()
    got = run("box_muller", _isa_or_skip(isa), pairs, out_per_in=2)
    assert_same_bits(got, run("box_muller", "scalar", pairs, out_per_in=2), "box_muller")
    sub = slice(None, None, 257)
    z0, z1 = reference.box_muller(w0[sub], w1[sub])
    assert_same_bits(got[0::2][sub], z0, "z0 vs NumPy reference")
    assert_same_bits(got[1::2][sub], z1, "z1 vs NumPy reference")


def erfinv_inputs():
    one_minus = (np.uint32(0x3F800000) - np.arange(1, 20001, dtype=U32)).view(F32)  # 1 - k ulp
    # w = -log((1 - x)(1 + x)) = 5 at |x| = sqrt(1 - e^-5): both branches around the switch.
    sw = floats_near(np.array([np.sqrt(1 - np.exp(-5.0))], dtype=F32), 5000)
    small = np.concatenate([np.arange(0, 4096, dtype=U32).view(F32), np.float32([1e-30, 1e-10])])
    rnd = RNG.uniform(-1, 1, size=1 << 20).astype(F32)
    core_ = np.concatenate([one_minus, sw, small, rnd])
    return np.concatenate([core_, -core_]).astype(F32)


@pytest.mark.parametrize("isa", ISAS)
def test_erfinv(isa):
    x = erfinv_inputs()
    got = run("erfinv", _isa_or_skip(isa), x)
    assert_same_bits(got, run("erfinv", "scalar", x), "erfinv")
    with np.errstate(all="ignore"):
        assert_same_bits(got, reference.mm_erfinvf(x), "erfinv vs NumPy reference")
    # Outside (-1, 1) the values are meaningless but must still agree (NaN with NaN).
    odd = np.float32([1.0, -1.0, 1.5, -2.0, np.inf, -np.inf, np.nan])
    assert_same_or_both_nan(run("erfinv", isa, odd), run("erfinv", "scalar", odd), "erfinv odd")


def conversion_inputs():
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65519.99,
                           65520.0, -65520.0, 6.1035156e-05, 5.9604645e-08, 2.9802322e-08,
                           2.9802326e-08, 1e-45, 3.4028235e38])
    near = floats_near(np.float32([6.1035156e-05, 5.9604645e-08, 65504.0, 1.0, 1e-3]), 600)
    rnd = RNG.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(U32).view(F32)
    return np.concatenate([specials, near, -near, rnd]).astype(F32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fn", ["f16", "bf16"])
def test_store_conversions(isa, fn):
    x = conversion_inputs()
    if fn == "f16" and isa != "x86-64":
        # F16C keeps NaN payload bits that c10's conversion replaces by 0x7E00; the engine
        # never produces such NaNs (a Constant NaN is the quiet NaN, same in both).
        x = x[~np.isnan(x) | (x.view(U32) & U32(0x7FFFFFFF) == U32(0x7FC00000))]
    got = run(fn, _isa_or_skip(isa), x, out_dtype=np.uint16)
    want = run(fn, "scalar", x, out_dtype=np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (fn, x[bad[:5]], got[bad[:5]], want[bad[:5]])
    if fn == "f16":
        ok = ~np.isnan(x)
        with np.errstate(over="ignore"):
            assert (want[ok] == x[ok].astype(np.float16).view(np.uint16)).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100])
def test_tails(isa, n):
    """Counts around the lane widths: every element computed, nothing written past n."""
    _isa_or_skip(isa)
    w = RNG.integers(0, 1 << 32, size=2 * n, dtype=np.uint64).astype(U32)
    cases = (("box_muller", w, 2), ("sincos", w[:n], 2), ("log", w[:n].view(F32), 1),
             ("erfinv", RNG.uniform(-1, 1, n).astype(F32), 1))
    for fn, inp, per in cases:
        assert_same_or_both_nan(run(fn, isa, inp, per), run(fn, "scalar", inp, per), (fn, n))


def test_bad_names_are_errors():
    x = np.zeros(4, dtype=F32)
    with pytest.raises(RuntimeError, match="unknown math function"):
        core().cpu_math("tan", "scalar", x.ctypes.data, x.ctypes.data, 4)
    with pytest.raises(RuntimeError, match="unknown CPU kernel"):
        core().cpu_math("log", "sse9", x.ctypes.data, x.ctypes.data, 4)
    missing = [i for i in ISAS if i not in core().cpu_kernels()]
    if missing:
        with pytest.raises(RuntimeError, match="cannot run"):
            core().cpu_math("log", missing[0], x.ctypes.data, x.ctypes.data, 4)


def test_kernel_choice_is_runnable():
    kernels = core().cpu_kernels()
    assert kernels[-1] == "x86-64" and core().cpu_kernel() in kernels
