// Counter-based RNG and the value transforms of the init engine, for host and device.
//
// The value of element (r, c) of a table is a pure function of (philox key, r, c, dist).
// Columns come in blocks of 32 (c >> 5); in a block, column c uses word i = (c >> 3) & 3 of
// the Philox call with counter g = (c >> 5) * 8 + (c & 7):
//   words = Philox4x32-10(counter = {g_lo, r_lo, r_hi, g_hi}, key = {k_lo, k_hi})
// so word i of 8 consecutive counters covers 8 consecutive columns (vector stores, no
// transpose). Uniform and truncated normal use word i alone; the normal pairs words (0, 1)
// and (2, 3) in Box-Muller (word 0/2 -> cos branch, word 1/3 -> sin branch).
// Every transform uses only IEEE float32 +, -, *, sqrt and integer ops, in a fixed order,
// with no FMA contraction (CPU: -ffp-contract=off; CUDA: --fmad=false). log, sin, cos and
// erfinv are our own polynomials, so CPU, CUDA and the NumPy reference (metamat/reference.py)
// agree bit for bit. Keep all three in sync.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MM_HD __host__ __device__ __forceinline__
#else
#define MM_HD inline __attribute__((always_inline))
#endif

namespace metamat {

enum class DistKind : int32_t { kUniform = 0, kNormal = 1, kTruncNormal = 2, kConstant = 3 };

struct Philox4 {
  uint32_t v[4];
};

// Counter of global column c, and which of its four words column c takes.
MM_HD uint64_t counter_of_col(uint64_t c) { return (c >> 5) * 8 + (c & 7); }
MM_HD int word_of_col(uint64_t c) { return static_cast<int>((c >> 3) & 3); }

MM_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Philox4x32-10 (Salmon et al., SC'11), the generator of cuRAND and torch.
MM_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                            uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < 10; ++i) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo(M0, c0, &hi0);
    uint32_t lo1 = mulhilo(M1, c2, &hi1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

MM_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
MM_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// u in [0, 1): the top 24 bits of x times 2^-24 (exact in float32).
MM_HD float uniform01(uint32_t x) { return static_cast<float>(x >> 8) * 5.9604644775390625e-8f; }
// u in (0, 1]: never 0, so log(u) is finite.
MM_HD float uniform01_open0(uint32_t x) {
  return static_cast<float>((x >> 8) + 1u) * 5.9604644775390625e-8f;
}

// Natural log for x in [FLT_MIN, +inf) (cephes logf); x < FLT_MIN gives -inf.
MM_HD float mm_logf(float x) {
  uint32_t b = float_to_bits(x);
  float e = static_cast<float>(static_cast<int32_t>((b >> 23) & 0xffu) - 126);
  float m = bits_to_float((b & 0x807fffffu) | 0x3f000000u);  // [0.5, 1)
  bool small = m < 0.707106781186547524f;
  e = small ? e - 1.0f : e;
  m = small ? (m + m) - 1.0f : m - 1.0f;
  float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m + -1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m + -1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m + -1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m + -2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m;
  y = y * z;
  y = y + e * -2.12194440e-4f;
  y = y + z * -0.5f;
  float r = m + y;
  r = r + e * 0.693359375f;
  return x < 1.17549435e-38f ? bits_to_float(0xff800000u) : r;
}

// sin and cos of 2*pi*k/2^24 for a 24-bit k: quadrant from the integer, cephes polynomials
// on [-pi/4, pi/4].
MM_HD void mm_sincos_turns(uint32_t k, float* s_out, float* c_out) {
  uint32_t q = (k + (1u << 21)) >> 22;                        // nearest quarter turn, 0..4
  int32_t t_int = static_cast<int32_t>(k) - static_cast<int32_t>(q << 22);  // [-2^21, 2^21)
  float phi = static_cast<float>(t_int) * 2.384185791015625e-7f;  // t in [-0.5, 0.5), exact
  phi = phi * 1.57079637050628662109375f;                          // * pi/2
  float z = phi * phi;
  float s = -1.9515295891e-4f;
  s = s * z + 8.3321608736e-3f;
  s = s * z + -1.6666654611e-1f;
  s = s * z;
  s = s * phi + phi;
  float c = 2.443315711809948e-5f;
  c = c * z + -1.388731625493765e-3f;
  c = c * z + 4.166664568298827e-2f;
  c = c * z;
  c = c * z;
  c = c + z * -0.5f;
  c = c + 1.0f;
  q &= 3u;
  float sq = (q == 0u) ? s : (q == 1u) ? c : (q == 2u) ? -s : -c;
  float cq = (q == 0u) ? c : (q == 1u) ? -s : (q == 2u) ? -c : s;
  *s_out = sq;
  *c_out = cq;
}

// Two standard normals from two words (Box-Muller).
MM_HD void box_muller(uint32_t w0, uint32_t w1, float* z0, float* z1) {
  float r = -2.0f * mm_logf(uniform01_open0(w0));
#if defined(__CUDA_ARCH__)
  r = __fsqrt_rn(r);
#else
  r = __builtin_sqrtf(r);
#endif
  float s, c;
  mm_sincos_turns(w1 >> 8, &s, &c);
  *z0 = r * c;
  *z1 = r * s;
}

// erfinv for x in (-1, 1) (M. Giles, "Approximating the erfinv function", single precision).
MM_HD float mm_erfinvf(float x) {
  float w = -mm_logf((1.0f - x) * (1.0f + x));
  float w1 = w - 2.5f;
  float p1 = 2.81022636e-08f;
  p1 = 3.43273939e-07f + p1 * w1;
  p1 = -3.5233877e-06f + p1 * w1;
  p1 = -4.39150654e-06f + p1 * w1;
  p1 = 0.00021858087f + p1 * w1;
  p1 = -0.00125372503f + p1 * w1;
  p1 = -0.00417768164f + p1 * w1;
  p1 = 0.246640727f + p1 * w1;
  p1 = 1.50140941f + p1 * w1;
#if defined(__CUDA_ARCH__)
  float w2 = __fsqrt_rn(w) - 3.0f;
#else
  float w2 = __builtin_sqrtf(w) - 3.0f;
#endif
  float p2 = -0.000200214257f;
  p2 = 0.000100950558f + p2 * w2;
  p2 = 0.00134934322f + p2 * w2;
  p2 = -0.00367342844f + p2 * w2;
  p2 = 0.00573950773f + p2 * w2;
  p2 = -0.0076224613f + p2 * w2;
  p2 = 0.00943887047f + p2 * w2;
  p2 = 1.00167406f + p2 * w2;
  p2 = 2.83297682f + p2 * w2;
  float p = (w < 5.0f) ? p1 : p2;
  return p * x;
}

// ---- Variant math (fill_variant.h `math`, CUDA kernel variants only) ------------------------
// The float operations above in the same order, with fewer instructions around them; each
// function equals its plain counterpart bit for bit on the inputs named (checked exhaustively
// over all 2^24 inputs through _C.fill_variant_math_check, tests/test_fill_cuda_variants.py).

// mm_logf(uniform01_open0(w)) for every w. x = n 2^-24 with n = (w >> 8) + 1 in [1, 2^24] has
// the mantissa of float(n) (exact) and its exponent less 24, so: no multiply by 2^-24, the
// exponent is an integer until its one conversion (e - 1 for a small mantissa is exact either
// way), the mantissa in [sqrt(1/2), sqrt(2)) is chosen by its bits (m < 0.70710677f exactly
// when the bits are below 0x3504f3; 2m is m with the exponent raised, so (m + m) - 1 ==
// bits(mant | 0x3f800000) - 1), and x >= 2^-24 needs no check for x < FLT_MIN.
MM_HD float mm_log_open0(uint32_t w) {
  const uint32_t n = (w >> 8) + 1u;
  const uint32_t b = float_to_bits(static_cast<float>(n));
  const uint32_t mant = b & 0x007fffffu;
  const bool small = mant < 0x003504f3u;  // 0.707106781186547524f == bits 0x3f3504f3
  const float e = static_cast<float>(static_cast<int32_t>(b >> 23) - (24 + 126) - (small ? 1 : 0));
  const float m = bits_to_float(mant | (small ? 0x3f800000u : 0x3f000000u)) - 1.0f;
  float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m + -1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m + -1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m + -1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m + -2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m;
  y = y * z;
  y = y + e * -2.12194440e-4f;
  y = y + z * -0.5f;
  float r = m + y;
  r = r + e * 0.693359375f;
  return r;
}

// mm_sincos_turns with the quadrant applied as one select per output and a sign bit: q = 0..3
// gives (s, c), (c, -s), (-s, -c), (-c, s); negation is the sign bit in IEEE arithmetic.
MM_HD void mm_sincos_turns_sel(uint32_t k, float* s_out, float* c_out) {
  uint32_t q = (k + (1u << 21)) >> 22;
  int32_t t_int = static_cast<int32_t>(k) - static_cast<int32_t>(q << 22);
  float phi = static_cast<float>(t_int) * 2.384185791015625e-7f;
  phi = phi * 1.57079637050628662109375f;
  float z = phi * phi;
  float s = -1.9515295891e-4f;
  s = s * z + 8.3321608736e-3f;
  s = s * z + -1.6666654611e-1f;
  s = s * z;
  s = s * phi + phi;
  float c = 2.443315711809948e-5f;
  c = c * z + -1.388731625493765e-3f;
  c = c * z + 4.166664568298827e-2f;
  c = c * z;
  c = c * z;
  c = c + z * -0.5f;
  c = c + 1.0f;
  const bool odd = (q & 1u) != 0u;
  const uint32_t sin_sign = (q & 2u) << 30;          // q = 2, 3
  const uint32_t cos_sign = ((q + 1u) & 2u) << 30;   // q = 1, 2
  *s_out = bits_to_float(float_to_bits(odd ? c : s) ^ sin_sign);
  *c_out = bits_to_float(float_to_bits(odd ? s : c) ^ cos_sign);
}

// box_muller through the two functions above.
MM_HD void box_muller_sel(uint32_t w0, uint32_t w1, float* z0, float* z1) {
  float r = -2.0f * mm_log_open0(w0);
#if defined(__CUDA_ARCH__)
  r = __fsqrt_rn(r);
#else
  r = __builtin_sqrtf(r);
#endif
  float s, c;
  mm_sincos_turns_sel(w1 >> 8, &s, &c);
  *z0 = r * c;
  *z1 = r * s;
}

// mm_erfinvf where w < 5 is known (kErfinvCentral, fill_units.h): the first polynomial only.
MM_HD float mm_erfinvf_central(float x) {
  float w = -mm_logf((1.0f - x) * (1.0f + x));
  float w1 = w - 2.5f;
  float p1 = 2.81022636e-08f;
  p1 = 3.43273939e-07f + p1 * w1;
  p1 = -3.5233877e-06f + p1 * w1;
  p1 = -4.39150654e-06f + p1 * w1;
  p1 = 0.00021858087f + p1 * w1;
  p1 = -0.00125372503f + p1 * w1;
  p1 = -0.00417768164f + p1 * w1;
  p1 = 0.246640727f + p1 * w1;
  p1 = 1.50140941f + p1 * w1;
  return p1 * x;
}

// Distribution parameters as the kernels take them (prepared on the host, see fill.h).
// uniform: p0 = a, p1 = b - a | normal: p0 = mean, p1 = std | constant: p0 = value |
// trunc normal: p0 = mean, p1 = std*sqrt(2), p2 = lo, p3 = hi - lo (lo, hi = 2*Phi(.) - 1),
// result clamped to [clamp_lo, clamp_hi] = [a, b].
struct DistParams {
  int32_t kind;
  float p0, p1, p2, p3, clamp_lo, clamp_hi;
};

// The four float32 values of one Philox group, by distribution.
MM_HD void transform4(const DistParams& d, const Philox4& w, float out[4]) {
  switch (static_cast<DistKind>(d.kind)) {
    case DistKind::kUniform:
      for (int i = 0; i < 4; ++i) out[i] = d.p0 + uniform01(w.v[i]) * d.p1;
      break;
    case DistKind::kNormal: {
      float z[4];
      box_muller(w.v[0], w.v[1], &z[0], &z[1]);
      box_muller(w.v[2], w.v[3], &z[2], &z[3]);
      for (int i = 0; i < 4; ++i) out[i] = d.p0 + d.p1 * z[i];
      break;
    }
    case DistKind::kTruncNormal:
      for (int i = 0; i < 4; ++i) {
        float p = d.p2 + uniform01(w.v[i]) * d.p3;
        float v = d.p0 + d.p1 * mm_erfinvf(p);
        v = v < d.clamp_lo ? d.clamp_lo : v;
        out[i] = v > d.clamp_hi ? d.clamp_hi : v;
      }
      break;
    default:
      for (int i = 0; i < 4; ++i) out[i] = d.p0;
  }
}

}  // namespace metamat
