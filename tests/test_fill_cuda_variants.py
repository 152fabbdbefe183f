"""Every variant of the CUDA init kernel (csrc/include/metamat/fill_variant.h: the A/B builds a GPU
run times against fill_) writes what the CPU engine writes, bit for bit, through the kernel's host
emulation (the same unit/warp templates and tile walk as the kernel), with one or several tiles
per thread block; the variant math equals the plain math over every input; the diagnostic
variant stores raw Philox words; the environment picks variants and is validated."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import metamat
from metamat._ext import core
from metamat.init import _pack
from metamat.keys import philox_key
from metamat.reference import philox4x32_10
from conftest import bits
from test_fill_cuda_emulated import DISTS, DTYPES, assert_same, make_block

VARIANTS = [v for v in core().fill_variants() if not v["diagnostic"]]
IDS = [v["name"] for v in VARIANTS]


def run_both(specs, seed, variant, tiles, dists=DISTS, force_wide=False):
    """specs: (rows, cols, pad, dtype_i, dist_i, r0, c0[, shift]) -> (emulated, cpu, stats)."""
    out = []
    for _ in range(2):
        bufs, items = [], []
        for i, spec in enumerate(specs):
            rows, cols, pad, di, ki, r0, c0 = spec[:7]
            buf, view = make_block(rows, cols, pad, DTYPES[di], spec[7] if len(spec) > 7 else 0)
            bufs.append(buf)
            items.append((view, dists[ki], f"t{i % 7}", r0, c0))
        out.append((bufs, items))
    segs = _pack(out[0][1], seed)
    stats = core().fill_cuda_emulated_variant(segs.ctypes.data, len(segs), force_wide, variant,
                                              tiles)
    metamat.fill_many_(out[1][1], seed=seed)
    return out[0][0], out[1][0], stats


def test_the_variant_table():
    names = {v["name"]: v for v in core().fill_variants()}
    assert names["base"]["id"] == 0 and not names["base"]["diagnostic"]
    assert names["philoxbits"]["diagnostic"]
    assert names["spec"]["specialized"] and names["specsplit"]["specialized"]
    assert len({v["id"] for v in names.values()}) == len(names)


@pytest.mark.parametrize("variant", [v["id"] for v in VARIANTS], ids=IDS)
@pytest.mark.parametrize("dtype_i", range(4), ids=lambda i: str(DTYPES[i]))
def test_narrow_unaligned_and_aligned_tables(variant, dtype_i):
    # every distribution; D = 1..40 at unaligned offsets, strides and pointers (edge units),
    # and 32-column multiples (interior units, staged), in one launch, 1 and 3 tiles per block
    specs = [(5, d, pad, dtype_i, k, 17 * d, c0 + 64 * d, shift)
             for k in range(4) for d in range(1, 41, 3)
             for c0, pad, shift in [(0, 0, 0), (3, 1, 1), (29, 0, 1)]]
    specs += [(9, 96, 32, dtype_i, k, 5, 64) for k in range(4)]
    for tiles in (1, 3):
        emulated, cpu, stats = run_both(specs, 3, variant, tiles)
        assert_same(emulated, cpu)
        assert stats["vector_stores"] > 0 and stats["scalar_stores"] > 0


@pytest.mark.parametrize("variant", [v["id"] for v in VARIANTS], ids=IDS)
@pytest.mark.parametrize("tiles", [1, 3, 8])
def test_many_small_tables_walked_by_blocks(variant, tiles):
    # 400 tables (empty ones between) of one tile, every tenth of two or three: a block's tiles
    # cross segments, the last block is short, every tile is run once
    specs = [((1100 if i % 10 == 0 else 3) if i % 11 else 0, 32 * (1 + i % 3), 0, i % 3, i % 3,
              i, 32 * (i % 5)) for i in range(400)]
    emulated, cpu, stats = run_both(specs, 9, variant, tiles)
    assert_same(emulated, cpu)
    units = sum(s[0] * (s[1] // 32) for s in specs)
    assert stats["philox_calls"] == 8 * sum(s[0] * (s[1] // 32) for s in specs if s[4] != 3)
    assert stats["tiles"] >= units // 1024


@pytest.mark.parametrize("variant", [v["id"] for v in VARIANTS], ids=IDS)
def test_64_bit_offsets_and_wide_index(variant):
    specs = [(700, 333, 3, 0, 1, 2**33 + 5, 2**20 + 3), (5, 40, 0, 2, 0, 2**40 - 2, 2**31 + 7, 1),
             (3, 100, 0, 1, 2, 2**40 + 2**35, 17), (2, 64, 0, 3, 1, 2**62, 2**40 + 32)]
    for force_wide in (False, True):
        emulated, cpu, _ = run_both(specs, 1, variant, 2, force_wide=force_wide)
        assert_same(emulated, cpu)


# Scales whose 2^-24 multiple is not a normal float (the fold falls back), scales at the edge of
# it, huge ones, truncations wide enough to reach erfinv's w >= 5 branch, negative scales.
EDGE_DISTS = [metamat.Uniform(0.0, 1e-35), metamat.Uniform(-1e-36, 1e-36),
              metamat.Uniform(0.0, 2.0**-102), metamat.Uniform(0.0, 1.5 * 2.0**-102),
              metamat.Uniform(-1e38, 1e38), metamat.Uniform(1.0, 1.0000001),
              metamat.TruncatedNormal(0.0, 1.0, -6.0, 6.0), metamat.TruncatedNormal(0, 1, 0, 1e-30),
              metamat.TruncatedNormal(3.0, 0.5, 2.9, 3.1), metamat.Normal(-2.0, 1e-20)]


@pytest.mark.parametrize("variant", [v["id"] for v in VARIANTS], ids=IDS)
def test_scales_that_do_and_do_not_fold(variant):
    specs = [(40, 64, 0, di, k, 3 * k, 32 * di) for k in range(len(EDGE_DISTS)) for di in range(3)]
    specs += [(7, 13, 1, 0, k, 1, 3, 1) for k in range(len(EDGE_DISTS))]
    emulated, cpu, _ = run_both(specs, 12, variant, 1, dists=EDGE_DISTS)
    assert_same(emulated, cpu)


@settings(max_examples=25, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 100), st.integers(0, 5),
                                st.integers(0, 3), st.integers(0, 3), st.integers(0, 10**6),
                                st.integers(0, 300), st.integers(0, 3)), min_size=1, max_size=10),
       seed=st.integers(0, 2**32), variant=st.sampled_from([v["id"] for v in VARIANTS]),
       tiles=st.integers(1, 4))
def test_random_launches(specs, seed, variant, tiles):
    emulated, cpu, _ = run_both(specs, seed, variant, tiles)
    assert_same(emulated, cpu)


@pytest.mark.parametrize("fn,param", [("log_open0", 0.0), ("sincos", 0.0), ("erfinv", 0.0),
                                      ("uniform_fold", 0.2), ("uniform_fold", -7.5),
                                      ("uniform_fold", 2.0**-102), ("uniform_fold", 3e38),
                                      ("uniform_fold", 1e-35)])
def test_variant_math_equals_plain_math_on_every_input(fn, param):
    r = core().fill_variant_math_check(fn, param)
    assert r["checked"] >= 2**24
    assert r["mismatches"] == 0, r
    if fn == "uniform_fold":
        assert r["folded"] == (param != 1e-35)


def test_philoxbits_diagnostic_stores_the_words():
    # fp32 Uniform segments store word (c >> 3) & 3 of counter g(c) as its bits
    rows, cols, r0, c0, seed = 5, 96, 1000, 64, 7
    t = torch.full((rows, cols), float("nan"))
    segs = _pack([(t, metamat.Uniform(), "k", r0, c0)], seed)
    diag = next(v["id"] for v in core().fill_variants() if v["name"] == "philoxbits")
    core().fill_cuda_emulated_variant(segs.ctypes.data, len(segs), False, diag, 1)
    c = np.arange(c0, c0 + cols, dtype=np.uint64)[None, :]
    r = np.arange(r0, r0 + rows, dtype=np.uint64)[:, None]
    g = (c >> np.uint64(5)) * np.uint64(8) + (c & np.uint64(7))
    gg, rr = np.broadcast_arrays(g, r)
    k = philox_key(seed, "k")
    words = philox4x32_10(gg, rr & np.uint64(0xFFFFFFFF), rr >> np.uint64(32),
                          np.zeros_like(gg), k & 0xFFFFFFFF, k >> 32)
    want = np.choose(np.broadcast_to(((c >> np.uint64(3)) & np.uint64(3)).astype(np.int64),
                                     gg.shape), words)
    assert np.array_equal(t.numpy().view(np.uint32), want)


def test_environment_picks_and_validates(monkeypatch):
    monkeypatch.delenv("METAMAT_FILL_VARIANT", raising=False)
    monkeypatch.delenv("METAMAT_FILL_TILES", raising=False)
    assert core().fill_options() == (0, 1)
    monkeypatch.setenv("METAMAT_FILL_VARIANT", "split")
    monkeypatch.setenv("METAMAT_FILL_TILES", "4")
    assert core().fill_options() == (2, 4)
    assert core().fill_options(1, 2) == (1, 2)  # explicit arguments win
    monkeypatch.setenv("METAMAT_FILL_VARIANT", "6")
    assert core().fill_options()[0] == 6
    for bad_v, bad_t in [("nope", "1"), ("99", "1"), ("0", "0"), ("0", "x"), ("0", "5000")]:
        monkeypatch.setenv("METAMAT_FILL_VARIANT", bad_v)
        monkeypatch.setenv("METAMAT_FILL_TILES", bad_t)
        with pytest.raises(RuntimeError, match="variant|METAMAT_FILL_TILES"):
            core().fill_options()
    # the emulated device (fill_many_emulated_) follows the environment, with the same values
    monkeypatch.setenv("METAMAT_FILL_VARIANT", "math")
    monkeypatch.setenv("METAMAT_FILL_TILES", "3")
    a = torch.full((300, 64), float("nan"))
    b = torch.full((300, 64), float("nan"))
    metamat.init.fill_many_emulated_([(a, metamat.Normal(0, 1), "e", 0, 0)])
    metamat.fill_(b, metamat.Normal(0, 1), key="e")
    assert torch.equal(bits(a), bits(b))


def test_variant_kernels_built_flag_is_a_bool():
    assert core().fill_variants_built() in (True, False)


def test_a_build_without_the_variant_kernels_refuses_them_before_any_cuda_call():
    if core().fill_variants_built() or not core().cuda_compiled():
        return  # the refusal belongs to CUDA builds without METAMAT_FILL_VARIANTS
    t = torch.zeros(4, 32)
    segs = _pack([(t, metamat.Uniform(), "k", 0, 0)], 0)
    for variant, tiles in ((1, 1), (0, 2)):
        with pytest.raises(RuntimeError, match="METAMAT_FILL_VARIANTS=1"):
            core().fill_cuda_variant(segs.ctypes.data, len(segs), segs.ctypes.data, 1, 0,
                                     variant, tiles)
