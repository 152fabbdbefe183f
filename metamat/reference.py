"""Pure-NumPy reference of the init engine: slow, obviously right, bit-exact with the core.

It follows csrc/include/metamat/philox.h operation by operation in float32 (NumPy rounds each
float32 operation and never fuses multiply-add), so the C++ and CUDA outputs must equal it bit for
bit. Used by the tests; never on a hot path.
"""
from __future__ import annotations

import numpy as np
import torch

from .init import dist_params
from .keys import philox_key
from .spec import Dist

F = np.float32
U32 = np.uint32
_M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 on arrays of uint32 counters; returns four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        n0 = (p1 >> np.uint64(32)) ^ c1 ^ k0
        n2 = (p0 >> np.uint64(32)) ^ c3 ^ k1
        c0, c1, c2, c3 = n0, p1 & _M32, n2, p0 & _M32
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return tuple(c.astype(U32) for c in (c0, c1, c2, c3))


def uniform01(x):
    return (x >> U32(8)).astype(F) * F(5.9604644775390625e-8)


def uniform01_open0(x):
    return ((x >> U32(8)) + U32(1)).astype(F) * F(5.9604644775390625e-8)


def mm_logf(x):
    """The core's log (cephes logf) for float32 arrays; x < FLT_MIN gives -inf."""
    x = np.asarray(x, dtype=F)
    b = x.view(U32)
    e = (((b >> U32(23)) & U32(0xFF)).astype(np.int32) - 126).astype(F)
    m = ((b & U32(0x807FFFFF)) | U32(0x3F000000)).view(F)
    small = m < F(0.707106781186547524)
    e = np.where(small, e - F(1.0), e)
    m = np.where(small, (m + m) - F(1.0), m - F(1.0))
    z = m * m
    y = np.full_like(m, F(7.0376836292e-2))
    for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
              -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
        y = y * m + F(c)
    y = y * m
    y = y * z
    y = y + e * F(-2.12194440e-4)
    y = y + z * F(-0.5)
    r = m + y
    r = r + e * F(0.693359375)
    return np.where(x < F(1.17549435e-38), F(-np.inf), r)


def mm_sincos_turns(k):
    """sin and cos of 2*pi*k/2**24 for uint32 k < 2**24."""
    k = np.asarray(k, dtype=U32)
    q = (k + U32(1 << 21)) >> U32(22)
    t = k.astype(np.int32) - (q << U32(22)).astype(np.int32)
    phi = t.astype(F) * F(2.384185791015625e-7)
    phi = phi * F(1.57079637050628662109375)
    z = phi * phi
    s = np.full_like(phi, F(-1.9515295891e-4))
    s = s * z + F(8.3321608736e-3)
    s = s * z + F(-1.6666654611e-1)
    s = s * z
    s = s * phi + phi
    c = np.full_like(phi, F(2.443315711809948e-5))
    c = c * z + F(-1.388731625493765e-3)
    c = c * z + F(4.166664568298827e-2)
    c = c * z
    c = c * z
    c = c + z * F(-0.5)
    c = c + F(1.0)
    q = q & U32(3)
    sq = np.select([q == 0, q == 1, q == 2], [s, c, -s], -c)
    cq = np.select([q == 0, q == 1, q == 2], [c, -s, -c], s)
    return sq.astype(F), cq.astype(F)


def box_muller(w0, w1):
    r = F(-2.0) * mm_logf(uniform01_open0(w0))
    r = np.sqrt(r)
    s, c = mm_sincos_turns(w1 >> U32(8))
    return r * c, r * s


def mm_erfinvf(x):
    """The core's erfinv (Giles' single-precision approximation)."""
    x = np.asarray(x, dtype=F)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = -mm_logf((F(1.0) - x) * (F(1.0) + x))
        w1 = w - F(2.5)
        p1 = np.full_like(x, F(2.81022636e-08))
        for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                  -0.00125372503, -0.00417768164, 0.246640727, 1.50140941):
            p1 = F(c) + p1 * w1
        w2 = np.sqrt(w) - F(3.0)
        p2 = np.full_like(x, F(-0.000200214257))
        for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                  -0.0076224613, 0.00943887047, 1.00167406, 2.83297682):
            p2 = F(c) + p2 * w2
        p = np.where(w < F(5.0), p1, p2)
        return p * x


def values_f32(dist: Dist, seed: int, key: str, rows, cols) -> np.ndarray:
    """float32 values at global rows x cols (broadcastable integer arrays)."""
    kind, p, clamp = dist_params(dist)
    rows = np.asarray(rows, dtype=np.uint64)
    cols = np.asarray(cols, dtype=np.uint64)
    shape = np.broadcast_shapes(rows.shape, cols.shape)
    if kind == 3:
        return np.full(shape, F(p[0]), dtype=F)
    g = (cols >> np.uint64(5)) * np.uint64(8) + (cols & np.uint64(7))
    word = ((cols >> np.uint64(3)) & np.uint64(3)).astype(np.int64)
    k = philox_key(seed, key)
    rr, gg = np.broadcast_arrays(rows, g)
    words = philox4x32_10(gg & _M32, rr & _M32, rr >> np.uint64(32), gg >> np.uint64(32),
                          k & 0xFFFFFFFF, k >> 32)
    word = np.broadcast_to(word, shape)
    p0, p1, p2, p3 = (F(v) for v in p)
    if kind == 0:
        x = np.choose(word, words)
        return p0 + uniform01(x) * p1
    if kind == 1:
        z0, z1 = box_muller(words[0], words[1])
        z2, z3 = box_muller(words[2], words[3])
        z = np.choose(word, (z0, z1, z2, z3))
        return p0 + p1 * z
    x = np.choose(word, words)
    q = p2 + uniform01(x) * p3
    v = p0 + p1 * mm_erfinvf(q)
    v = np.where(v < F(clamp[0]), F(clamp[0]), v)
    return np.where(v > F(clamp[1]), F(clamp[1]), v).astype(F)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    u = a.astype(F).view(U32).astype(np.uint64)
    return ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint16)


def reference_block(shape, dist: Dist, *, seed: int = 0, key: str, row_offset: int = 0,
                    col_offset: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What ``metamat.fill_`` writes into a tensor of ``shape`` (1-D or 2-D) and ``dtype``."""
    if len(shape) == 1:
        rows = np.zeros((1, 1), dtype=np.uint64)
        cols = (row_offset + col_offset + np.arange(shape[0], dtype=np.uint64))[None, :]
    else:
        rows = (row_offset + np.arange(shape[0], dtype=np.uint64))[:, None]
        cols = (col_offset + np.arange(shape[1], dtype=np.uint64))[None, :]
    v = values_f32(dist, seed, key, rows, cols).reshape(shape)
    if dtype == torch.float32:
        return torch.from_numpy(np.ascontiguousarray(v))
    if dtype == torch.float64:
        return torch.from_numpy(v.astype(np.float64))
    if dtype == torch.float16:
        return torch.from_numpy(v.astype(np.float16))
    if dtype == torch.bfloat16:
        return torch.from_numpy(_bf16_bits(v).view(np.int16)).view(torch.bfloat16)
    raise TypeError(f"unsupported dtype {dtype}")
