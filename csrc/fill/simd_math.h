// The transforms of philox.h on simd_vec.h lanes (8 with AVX2, 4 with SSE2), N vectors in
// lockstep (simd_pack.h): uniform, log, sin/cos of a turn fraction, Box-Muller, erfinv.
//
// Every lane is bit-identical to the scalar function of philox.h: each float operation that
// rounds is the scalar's operation on the same operands in the same order (multiply, then
// add, never fused). Where the form differs (integer bit tricks, a select moved before a
// shared subtraction, an exact power-of-two scaling folded), the comment proves the rounded
// results equal, and tests/test_simd_math.py checks it exhaustively where the input domain is
// 2^24 values (Box-Muller's radius and angle words) and on edge cases elsewhere.
// Keep in sync with philox.h (scalar, host and CUDA) and metamat/reference.py.
#pragma once
#include "simd_pack.h"

namespace metamat {
namespace MM_ISA {
namespace simd {

// Broadcast constants of the functions below: K(c) is c in every lane of N vectors.
#define MM_K(c) splat<N>(c)
#define MM_KI(c) splati<N>(c)

template <int N> MM_SIMD PF<N> uniform01(PI<N> x) {
  return to_float(srli<8>(x)) * MM_K(5.9604644775390625e-8f);
}
template <int N> MM_SIMD PF<N> uniform01_open0(PI<N> x) {
  return to_float(srli<8>(x) + MM_KI(1u)) * MM_K(5.9604644775390625e-8f);
}

// The part of mm_logf after the split x = 2^e * m: ei is e as an integer (it is in
// [-150, 129], so float(ei) is exact), m the mantissa in [0.5, 1) (bits 0x3F000000 | frac).
template <int N>
MM_SIMD PF<N> log_core(PI<N> ei, PF<N> m) {
  const PF<N> small = lt(m, MM_K(0.707106781186547524f));
  // Scalar: e = float(ei); e = small ? e - 1 : e. float(ei) - 1.0f == float(ei - 1) exactly
  // (small integers); the mask lanes are the integer -1.
  const PF<N> e = to_float(ei + as_int(small));
  // Scalar: m = small ? (m + m) - 1 : m - 1. Selecting before the common "- 1" performs the
  // same operations on each lane.
  m = select(small, m + m, m) - MM_K(1.0f);
  const PF<N> z = m * m;
  PF<N> y = MM_K(7.0376836292e-2f);
  y = y * m + MM_K(-1.1514610310e-1f);
  y = y * m + MM_K(1.1676998740e-1f);
  y = y * m + MM_K(-1.2420140846e-1f);
  y = y * m + MM_K(1.4249322787e-1f);
  y = y * m + MM_K(-1.6668057665e-1f);
  y = y * m + MM_K(2.0000714765e-1f);
  y = y * m + MM_K(-2.4999993993e-1f);
  y = y * m + MM_K(3.3333331174e-1f);
  y = y * m;
  y = y * z;
  y = y + e * MM_K(-2.12194440e-4f);
  y = y + z * MM_K(-0.5f);
  const PF<N> r = m + y;
  return r + e * MM_K(0.693359375f);
}

// mm_logf: natural log for x >= FLT_MIN; x < FLT_MIN (zero, denormals, negatives) -> -inf.
template <int N>
MM_SIMD PF<N> logf(PF<N> x) {
  const PI<N> b = as_int(x);
  const PI<N> ei = (srli<23>(b) & MM_KI(0xFFu)) - MM_KI(126u);
  const PF<N> m = as_float((b & MM_KI(0x807FFFFFu)) | MM_KI(0x3F000000u));
  const PF<N> r = log_core(ei, m);
  return select(lt(x, MM_K(1.17549435e-38f)), as_float(MM_KI(0xFF800000u)), r);
}

// mm_sincos_turns(w >> 8): sin and cos of 2*pi*k/2^24, k = w >> 8, from the word w itself.
// Scalar: q = (k + 2^21) >> 22, t = k - (q << 22), phi = (float(t) * 2^-22) * pi/2, then the
// quadrant select on q & 3. Here, exactly equal:
// - v = w + 2^29 (mod 2^32) has v >> 30 == q & 3: bit 30 of v is bit 0 of q, bit 31 bit 1.
// - t is k mod 2^22 taken in [-2^21, 2^21): bits 8..29 of w as a signed 22-bit number, so
//   (int32)(w << 2) with its low 10 bits cleared is t * 2^10. float(t * 2^10) is exact, and
//   one multiply by (pi/2) * 2^-32 rounds the same real number t * 2^-22 * pi/2 as the
//   scalar's second multiply (its first, by 2^-22, is exact): phi is the same float.
template <int N>
MM_SIMD void sincos_word(PI<N> w, PF<N>* s_out, PF<N>* c_out) {
  const PF<N> phi = to_float(slli<2>(w) & MM_KI(0xFFFFFC00u)) *
                    MM_K(1.57079637050628662109375f * 0x1.0p-32f);
  const PF<N> z = phi * phi;
  PF<N> s = MM_K(-1.9515295891e-4f);
  s = s * z + MM_K(8.3321608736e-3f);
  s = s * z + MM_K(-1.6666654611e-1f);
  s = s * z;
  s = s * phi + phi;
  PF<N> c = MM_K(2.443315711809948e-5f);
  c = c * z + MM_K(-1.388731625493765e-3f);
  c = c * z + MM_K(4.166664568298827e-2f);
  c = c * z;
  c = c * z;
  c = c + z * MM_K(-0.5f);
  c = c + MM_K(1.0f);
  // Scalar: sin = {s, c, -s, -c}[q & 3], cos = {c, -s, -c, s}[q & 3]. Odd q swaps s and c;
  // bit 1 of q negates the sine; bit 1 of q + 1, i.e. bit 1 ^ bit 0 (q = 1, 2), negates the
  // cosine. Negation is a sign flip, exactly what the scalar unary minus does.
  const PI<N> v = w + MM_KI(1u << 29);
  const PI<N> swap = slli<1>(v);  // sign bit = bit 0 of q
  const PF<N> bs = select_msb(swap, c, s), bc = select_msb(swap, s, c);
  const PI<N> sign = MM_KI(0x80000000u);
  *s_out = as_float(as_int(bs) ^ (v & sign));
  *c_out = as_float(as_int(bc) ^ ((v ^ swap) & sign));
}

// box_muller: two standard normals from words w0 (radius) and w1 (angle): -2 * mm_logf of
// uniform01_open0(w0), then sqrt, times sincos_word(w1).
//
// The log and the sin/cos are independent chains, so they are written step by step side by
// side rather than one call after the other: the core overlaps the log's 9-step Horner chain
// with the sin/cos polynomials (Normal ~1.1x faster on Zen 3). Each value still goes through
// the rounded operations of log_core and sincos_word (see there; two exact rewrites noted
// below); tests/test_simd_math.py checks box_muller against philox.h on all 2^24 radius and
// angle words.
//
// The log's split: x = n * 2^-24 with n = (w0 >> 8) + 1 in [1, 2^24] is exact and normal, so
// its bits are those of float(n) (exact) with the exponent field lowered by 24: the split
// gives log_core's e and m with an exponent bias of 126 + 24 and no multiply. x > 0 (no sign
// bit to mask) and x >= 2^-24 > FLT_MIN (logf's -inf select would return r).
template <int N>
MM_SIMD void box_muller(PI<N> w0, PI<N> w1, PF<N>* z0, PF<N>* z1) {
  const PI<N> b = as_int(to_float(srli<8>(w0) + MM_KI(1u)));
  const PI<N> ei = srli<23>(b) - MM_KI(150u);
  PF<N> m = as_float((b & MM_KI(0x007FFFFFu)) | MM_KI(0x3F000000u));
  const PF<N> phi = to_float(slli<2>(w1) & MM_KI(0xFFFFFC00u)) *
                    MM_K(1.57079637050628662109375f * 0x1.0p-32f);
  const PF<N> small = lt(m, MM_K(0.707106781186547524f));
  const PF<N> zs = phi * phi;
  const PF<N> e = to_float(ei + as_int(small));
  // log_core's select(small, m + m, m) as m + (small ? m : +0): m + 0 == m for m in
  // [0.5, 1), and an and is no multiply-port blend (~1% faster).
  m = (m + as_float(as_int(m) & as_int(small))) - MM_K(1.0f);
  const PF<N> z = m * m;
  PF<N> y = MM_K(7.0376836292e-2f);
  PF<N> s = MM_K(-1.9515295891e-4f);
  PF<N> c = MM_K(2.443315711809948e-5f);
  y = y * m + MM_K(-1.1514610310e-1f);
  s = s * zs + MM_K(8.3321608736e-3f);
  c = c * zs + MM_K(-1.388731625493765e-3f);
  y = y * m + MM_K(1.1676998740e-1f);
  s = s * zs + MM_K(-1.6666654611e-1f);
  c = c * zs + MM_K(4.166664568298827e-2f);
  y = y * m + MM_K(-1.2420140846e-1f);
  s = s * zs;
  c = c * zs;
  y = y * m + MM_K(1.4249322787e-1f);
  s = s * phi + phi;
  c = c * zs;
  y = y * m + MM_K(-1.6668057665e-1f);
  c = c + zs * MM_K(-0.5f);
  y = y * m + MM_K(2.0000714765e-1f);
  c = c + MM_K(1.0f);
  const PI<N> v = w1 + MM_KI(1u << 29);  // quadrant select as in sincos_word
  const PI<N> swap = slli<1>(v);
  const PF<N> bs = select_msb(swap, c, s), bc = select_msb(swap, s, c);
  const PI<N> sign = MM_KI(0x80000000u);
  y = y * m + MM_K(-2.4999993993e-1f);
  y = y * m + MM_K(3.3333331174e-1f);
  y = y * m;
  y = y * z;
  y = y + e * MM_K(-2.12194440e-4f);
  y = y + z * MM_K(-0.5f);
  PF<N> r = m + y;
  r = r + e * MM_K(0.693359375f);
  r = sqrt(-(r + r));  // -2 * r: doubling and negation are exact, so the same float
  *z0 = r * as_float(as_int(bc) ^ ((v ^ swap) & sign));  // r * cos
  *z1 = r * as_float(as_int(bs) ^ (v & sign));           // r * sin
}

// mm_erfinvf (Giles): both branches computed, the w < 5 select picks one (as the scalar does).
template <int N>
MM_SIMD PF<N> erfinvf(PF<N> x) {
  const PF<N> w = -logf((MM_K(1.0f) - x) * (MM_K(1.0f) + x));
  const PF<N> w1 = w - MM_K(2.5f);
  PF<N> p1 = MM_K(2.81022636e-08f);
  p1 = MM_K(3.43273939e-07f) + p1 * w1;
  p1 = MM_K(-3.5233877e-06f) + p1 * w1;
  p1 = MM_K(-4.39150654e-06f) + p1 * w1;
  p1 = MM_K(0.00021858087f) + p1 * w1;
  p1 = MM_K(-0.00125372503f) + p1 * w1;
  p1 = MM_K(-0.00417768164f) + p1 * w1;
  p1 = MM_K(0.246640727f) + p1 * w1;
  p1 = MM_K(1.50140941f) + p1 * w1;
  const PF<N> w2 = sqrt(w) - MM_K(3.0f);
  PF<N> p2 = MM_K(-0.000200214257f);
  p2 = MM_K(0.000100950558f) + p2 * w2;
  p2 = MM_K(0.00134934322f) + p2 * w2;
  p2 = MM_K(-0.00367342844f) + p2 * w2;
  p2 = MM_K(0.00573950773f) + p2 * w2;
  p2 = MM_K(-0.0076224613f) + p2 * w2;
  p2 = MM_K(0.00943887047f) + p2 * w2;
  p2 = MM_K(1.00167406f) + p2 * w2;
  p2 = MM_K(2.83297682f) + p2 * w2;
  const PF<N> p = select(lt(w, MM_K(5.0f)), p1, p2);
  return p * x;
}

#undef MM_K
#undef MM_KI

// The distribution parameters (DistParams) as broadcast lanes, made once per row.
struct Params {
  VF p0, p1, p2, p3, lo, hi;
  explicit Params(const DistParams& d)
      : p0(set1(d.p0)), p1(set1(d.p1)), p2(set1(d.p2)), p3(set1(d.p3)), lo(set1(d.clamp_lo)),
        hi(set1(d.clamp_hi)) {}
};

// transform4 of philox.h for the uniform and the truncated normal (one word -> one value).
template <int N> MM_SIMD PF<N> uniform(const Params& d, PI<N> x) {
  return widen<N>(d.p0) + uniform01(x) * widen<N>(d.p1);
}
template <int N> MM_SIMD PF<N> trunc_normal(const Params& d, PI<N> x) {
  const PF<N> q = widen<N>(d.p2) + uniform01(x) * widen<N>(d.p3);
  PF<N> v = widen<N>(d.p0) + widen<N>(d.p1) * erfinvf(q);
  v = select(lt(v, widen<N>(d.lo)), widen<N>(d.lo), v);
  return select(gt(v, widen<N>(d.hi)), widen<N>(d.hi), v);
}
// ... and the normal (words 2j, 2j+1 -> values 2j, 2j+1).
template <int N> MM_SIMD void normal(const Params& d, PI<N> w0, PI<N> w1, PF<N>* v0,
                                     PF<N>* v1) {
  PF<N> z0, z1;
  box_muller(w0, w1, &z0, &z1);
  *v0 = widen<N>(d.p0) + widen<N>(d.p1) * z0;
  *v1 = widen<N>(d.p0) + widen<N>(d.p1) * z1;
}

}  // namespace simd
}  // namespace MM_ISA
}  // namespace metamat
