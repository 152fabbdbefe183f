// Lane types of the CPU init kernels: explicit AVX-512 (16 float32 lanes), AVX2 (8) or SSE2
// (4, the x86-64 baseline) intrinsics behind one small interface, so simd_math.h writes each
// transform once for every width.
//
// Bit-exactness: every float operation below is ONE IEEE float32 operation rounded to nearest
// even, exactly as the scalar code in philox.h does it: add, sub, mul, sqrt (correctly rounded,
// like __builtin_sqrtf), int32 -> float (exact for the |values| < 2^24 used here), compare,
// and sign flips / selects, which only move bits. Nothing is fused: no _mm256_fmadd_ps, and
// the build passes -ffp-contract=off so the compiler fuses nothing either.
//
// Included by fill_cpu_kernel.h inside `namespace metamat::MM_ISA`: each instruction-set build
// gets its own copy, so no inline function compiled with AVX2 can leak into the baseline build.
#pragma once
#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#else
#include <emmintrin.h>
#endif

#ifndef MM_ISA
#error "define MM_ISA before including simd_vec.h"
#endif

#define MM_SIMD inline __attribute__((always_inline))

namespace metamat {
namespace MM_ISA {
namespace simd {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
// ---------------------------------------------------------------- AVX-512: 16 lanes
// Why not the AVX2 code in this build: on Intel cores, while 512-bit operations (Philox) are
// in flight, port 1 executes no vector operations of any width, so 256-bit transforms run on
// half the ports (Normal was 0.75x the AVX2 kernel's speed on a Xeon "Emerald Rapids").
// Compares give AVX-512 mask registers; VF masks stay lanes of all ones / zeros (as the other
// widths), converted with vpmovm2d / vpmovd2m, because simd_math.h uses them as integers too.
constexpr int kW = 16;
struct VF { __m512 v; };
struct VI { __m512i v; };

MM_SIMD VF operator+(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
MM_SIMD VF operator-(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
MM_SIMD VF operator*(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
MM_SIMD VF sqrt(VF a) { return {_mm512_sqrt_ps(a.v)}; }
MM_SIMD VF set1(float x) { return {_mm512_set1_ps(x)}; }
MM_SIMD VI set1i(uint32_t x) { return {_mm512_set1_epi32(static_cast<int>(x))}; }
MM_SIMD VI iota(uint32_t a) {
  return {_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(a)),
                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                             15))};
}
MM_SIMD VF to_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
MM_SIMD VI as_int(VF a) { return {_mm512_castps_si512(a.v)}; }
MM_SIMD VF as_float(VI a) { return {_mm512_castsi512_ps(a.v)}; }
MM_SIMD VF lt(VF a, VF b) {
  return {_mm512_castsi512_ps(_mm512_movm_epi32(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)))};
}
MM_SIMD VF select(VF mask, VF a, VF b) {
  return {_mm512_mask_blend_ps(_mm512_movepi32_mask(_mm512_castps_si512(mask.v)), b.v, a.v)};
}
MM_SIMD VF select_msb(VI m, VF a, VF b) {
  return {_mm512_mask_blend_ps(_mm512_movepi32_mask(m.v), b.v, a.v)};
}

MM_SIMD VI operator+(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
MM_SIMD VI operator-(VI a, VI b) { return {_mm512_sub_epi32(a.v, b.v)}; }
MM_SIMD VI operator&(VI a, VI b) { return {_mm512_and_si512(a.v, b.v)}; }
MM_SIMD VI operator|(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
MM_SIMD VI operator^(VI a, VI b) { return {_mm512_xor_si512(a.v, b.v)}; }
template <int N> MM_SIMD VI srli(VI a) { return {_mm512_srli_epi32(a.v, N)}; }
template <int N> MM_SIMD VI slli(VI a) { return {_mm512_slli_epi32(a.v, N)}; }
template <int N> MM_SIMD VI srli64(VI a) { return {_mm512_srli_epi64(a.v, N)}; }
template <int N> MM_SIMD VI slli64(VI a) { return {_mm512_slli_epi64(a.v, N)}; }
MM_SIMD VI mul_even(VI a, VI b) { return {_mm512_mul_epu32(a.v, b.v)}; }
MM_SIMD VI blend_odd(VI a, VI b) { return {_mm512_mask_blend_epi32(0xAAAA, a.v, b.v)}; }

MM_SIMD VI load_i(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
MM_SIMD void store_i(uint32_t* p, VI a) { _mm512_storeu_si512(p, a.v); }
MM_SIMD VF load_f(const float* p) { return {_mm512_loadu_ps(p)}; }

MM_SIMD void store_f32(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
MM_SIMD void store_f64(double* p, VF a) {
  _mm512_storeu_pd(p, _mm512_cvtps_pd(_mm512_castps512_ps256(a.v)));
  _mm512_storeu_pd(p + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(a.v, 1)));
}
MM_SIMD void store_f16(uint16_t* p, VF a) {  // rounds to nearest even, as F16C does
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// 16 uint32 lanes holding values <= 0xFFFF -> 16 uint16 (vpmovdw keeps the low halves).
MM_SIMD void store_u16(uint16_t* p, VI a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v));
}
MM_SIMD VI nan_mask(VF a) {
  return {_mm512_movm_epi32(_mm512_cmpgt_epi32_mask(
      _mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7FFFFFFF)),
      _mm512_set1_epi32(0x7F800000)))};
}
MM_SIMD VI select_i(VI mask, VI a, VI b) {
  return {_mm512_mask_blend_epi32(_mm512_movepi32_mask(mask.v), b.v, a.v)};
}
// Lanes 0-7 of a then of b, and lanes 8-15 of a then of b: the AVX-512 kernel's 16 Philox
// counters write columns c..c+7 and c+32..c+39 of a word (philox.h), these put two words'
// values in column order.
MM_SIMD VF low_halves(VF a, VF b) { return {_mm512_shuffle_f32x4(a.v, b.v, 0x44)}; }
MM_SIMD VF high_halves(VF a, VF b) { return {_mm512_shuffle_f32x4(a.v, b.v, 0xEE)}; }

#elif defined(__AVX2__)
// ---------------------------------------------------------------- AVX2: 8 lanes
constexpr int kW = 8;
struct VF { __m256 v; };   // float32 lanes
struct VI { __m256i v; };  // uint32 lanes (or 4 uint64 lanes for the Philox multiplies)

MM_SIMD VF operator+(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
MM_SIMD VF operator-(VF a, VF b) { return {_mm256_sub_ps(a.v, b.v)}; }
MM_SIMD VF operator*(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
MM_SIMD VF sqrt(VF a) { return {_mm256_sqrt_ps(a.v)}; }
MM_SIMD VF set1(float x) { return {_mm256_set1_ps(x)}; }
MM_SIMD VI set1i(uint32_t x) { return {_mm256_set1_epi32(static_cast<int>(x))}; }
// Lane j holds a + j (32-bit lanes).
MM_SIMD VI iota(uint32_t a) {
  return {_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(a)),
                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))};
}
MM_SIMD VF to_float(VI a) { return {_mm256_cvtepi32_ps(a.v)}; }  // int32 -> float32
MM_SIMD VI as_int(VF a) { return {_mm256_castps_si256(a.v)}; }
MM_SIMD VF as_float(VI a) { return {_mm256_castsi256_ps(a.v)}; }
// Masks are VF lanes of all ones (true) or zeros, from ordered compares (false for NaN, like
// the scalar < and >).
MM_SIMD VF lt(VF a, VF b) { return {_mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ)}; }
// mask ? a : b, lane by lane.
MM_SIMD VF select(VF mask, VF a, VF b) { return {_mm256_blendv_ps(b.v, a.v, mask.v)}; }
// (top bit of m) ? a : b, lane by lane: blendv reads only the sign bit of the mask.
MM_SIMD VF select_msb(VI m, VF a, VF b) {
  return {_mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(m.v))};
}

MM_SIMD VI operator+(VI a, VI b) { return {_mm256_add_epi32(a.v, b.v)}; }
MM_SIMD VI operator-(VI a, VI b) { return {_mm256_sub_epi32(a.v, b.v)}; }
MM_SIMD VI operator&(VI a, VI b) { return {_mm256_and_si256(a.v, b.v)}; }
MM_SIMD VI operator|(VI a, VI b) { return {_mm256_or_si256(a.v, b.v)}; }
MM_SIMD VI operator^(VI a, VI b) { return {_mm256_xor_si256(a.v, b.v)}; }
template <int N> MM_SIMD VI srli(VI a) { return {_mm256_srli_epi32(a.v, N)}; }
template <int N> MM_SIMD VI slli(VI a) { return {_mm256_slli_epi32(a.v, N)}; }
template <int N> MM_SIMD VI srli64(VI a) { return {_mm256_srli_epi64(a.v, N)}; }
template <int N> MM_SIMD VI slli64(VI a) { return {_mm256_slli_epi64(a.v, N)}; }
// Full 64-bit products of the low (even) 32-bit lanes of each 64-bit lane.
MM_SIMD VI mul_even(VI a, VI b) { return {_mm256_mul_epu32(a.v, b.v)}; }
// Even 32-bit lanes from a, odd ones from b.
MM_SIMD VI blend_odd(VI a, VI b) { return {_mm256_blend_epi32(a.v, b.v, 0xAA)}; }

MM_SIMD VI load_i(const uint32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))};
}
MM_SIMD void store_i(uint32_t* p, VI a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.v);
}
MM_SIMD VF load_f(const float* p) { return {_mm256_loadu_ps(p)}; }

// Stores of 8 values converted to each destination type, bit-exact with dtype.h.
MM_SIMD void store_f32(float* p, VF a) { _mm256_storeu_ps(p, a.v); }
MM_SIMD void store_f64(double* p, VF a) {
  _mm256_storeu_pd(p, _mm256_cvtps_pd(_mm256_castps256_ps128(a.v)));
  _mm256_storeu_pd(p + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(a.v, 1)));
}
// F16C rounds to nearest even like f32_to_f16 (the AVX2 kernel is picked only with F16C).
MM_SIMD void store_f16(uint16_t* p, VF a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// 8 uint32 lanes holding values <= 0xFFFF -> 8 uint16.
MM_SIMD void store_u16(uint16_t* p, VI a) {
  const __m128i lo = _mm256_castsi256_si128(a.v), hi = _mm256_extracti128_si256(a.v, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
}
MM_SIMD VI nan_mask(VF a) {  // all ones where a is NaN: (bits & 0x7FFFFFFF) > 0x7F800000
  return {_mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(a.v),
                                              _mm256_set1_epi32(0x7FFFFFFF)),
                             _mm256_set1_epi32(0x7F800000))};
}
MM_SIMD VI select_i(VI mask, VI a, VI b) { return {_mm256_blendv_epi8(b.v, a.v, mask.v)}; }

#else
// ---------------------------------------------------------------- SSE2: 4 lanes
constexpr int kW = 4;
struct VF { __m128 v; };
struct VI { __m128i v; };

MM_SIMD VF operator+(VF a, VF b) { return {_mm_add_ps(a.v, b.v)}; }
MM_SIMD VF operator-(VF a, VF b) { return {_mm_sub_ps(a.v, b.v)}; }
MM_SIMD VF operator*(VF a, VF b) { return {_mm_mul_ps(a.v, b.v)}; }
MM_SIMD VF sqrt(VF a) { return {_mm_sqrt_ps(a.v)}; }
MM_SIMD VF set1(float x) { return {_mm_set1_ps(x)}; }
MM_SIMD VI set1i(uint32_t x) { return {_mm_set1_epi32(static_cast<int>(x))}; }
MM_SIMD VI iota(uint32_t a) {
  return {_mm_add_epi32(_mm_set1_epi32(static_cast<int>(a)), _mm_setr_epi32(0, 1, 2, 3))};
}
MM_SIMD VF to_float(VI a) { return {_mm_cvtepi32_ps(a.v)}; }
MM_SIMD VI as_int(VF a) { return {_mm_castps_si128(a.v)}; }
MM_SIMD VF as_float(VI a) { return {_mm_castsi128_ps(a.v)}; }
MM_SIMD VF lt(VF a, VF b) { return {_mm_cmplt_ps(a.v, b.v)}; }
MM_SIMD VF select(VF mask, VF a, VF b) {
  return {_mm_or_ps(_mm_and_ps(mask.v, a.v), _mm_andnot_ps(mask.v, b.v))};
}
MM_SIMD VF select_msb(VI m, VF a, VF b) {
  return select(as_float(VI{_mm_srai_epi32(m.v, 31)}), a, b);
}

MM_SIMD VI operator+(VI a, VI b) { return {_mm_add_epi32(a.v, b.v)}; }
MM_SIMD VI operator-(VI a, VI b) { return {_mm_sub_epi32(a.v, b.v)}; }
MM_SIMD VI operator&(VI a, VI b) { return {_mm_and_si128(a.v, b.v)}; }
MM_SIMD VI operator|(VI a, VI b) { return {_mm_or_si128(a.v, b.v)}; }
MM_SIMD VI operator^(VI a, VI b) { return {_mm_xor_si128(a.v, b.v)}; }
template <int N> MM_SIMD VI srli(VI a) { return {_mm_srli_epi32(a.v, N)}; }
template <int N> MM_SIMD VI slli(VI a) { return {_mm_slli_epi32(a.v, N)}; }
template <int N> MM_SIMD VI srli64(VI a) { return {_mm_srli_epi64(a.v, N)}; }
template <int N> MM_SIMD VI slli64(VI a) { return {_mm_slli_epi64(a.v, N)}; }
MM_SIMD VI mul_even(VI a, VI b) { return {_mm_mul_epu32(a.v, b.v)}; }
MM_SIMD VI blend_odd(VI a, VI b) {
  const __m128i odd = _mm_set_epi32(-1, 0, -1, 0);
  return {_mm_or_si128(_mm_andnot_si128(odd, a.v), _mm_and_si128(odd, b.v))};
}

MM_SIMD VI load_i(const uint32_t* p) {
  return {_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))};
}
MM_SIMD void store_i(uint32_t* p, VI a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), a.v); }
MM_SIMD VF load_f(const float* p) { return {_mm_loadu_ps(p)}; }

MM_SIMD void store_f32(float* p, VF a) { _mm_storeu_ps(p, a.v); }
MM_SIMD void store_f64(double* p, VF a) {
  _mm_storeu_pd(p, _mm_cvtps_pd(a.v));
  _mm_storeu_pd(p + 2, _mm_cvtps_pd(_mm_movehl_ps(a.v, a.v)));
}
// 4 uint32 lanes holding values <= 0xFFFF -> 4 uint16 (SSE2 has only the signed pack, so
// sign-extend the low halves first: the pack then keeps every bit pattern).
MM_SIMD void store_u16(uint16_t* p, VI a) {
  const __m128i s = _mm_srai_epi32(_mm_slli_epi32(a.v, 16), 16);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(s, s));
}
MM_SIMD VI nan_mask(VF a) {
  return {_mm_cmpgt_epi32(_mm_and_si128(_mm_castps_si128(a.v), _mm_set1_epi32(0x7FFFFFFF)),
                          _mm_set1_epi32(0x7F800000))};
}
MM_SIMD VI select_i(VI mask, VI a, VI b) {
  return {_mm_or_si128(_mm_and_si128(mask.v, a.v), _mm_andnot_si128(mask.v, b.v))};
}
MM_SIMD VI less_than(VI a, VI b) { return {_mm_cmplt_epi32(a.v, b.v)}; }  // signed

// dtype.h's f32_to_f16 (the FP16 library's algorithm), operation for operation, 4 lanes.
// The unsigned compares of the scalar code become signed ones on values shifted into range.
MM_SIMD void store_f16(uint16_t* p, VF f) {
  const VI w = as_int(f);
  VF base = (as_float(w & set1i(0x7FFFFFFFu)) * set1(0x1.0p+112f)) * set1(0x1.0p-110f);
  const VI shl1_w = w + w;
  const VI sign = w & set1i(0x80000000u);
  VI bias_top = srli<24>(shl1_w);  // bias >> 24, in [0, 255]: a signed compare is unsigned
  bias_top = select_i(less_than(bias_top, set1i(0x71u)), set1i(0x71u), bias_top);
  base = as_float(slli<23>(bias_top) + set1i(0x07800000u)) + base;  // (bias >> 1) + ...
  const VI bits = as_int(base);
  const VI nonsign = (srli<13>(bits) & set1i(0x00007C00u)) + (bits & set1i(0x00000FFFu));
  // shl1_w > 0xFF000000u  <=>  f is NaN
  store_u16(p, srli<16>(sign) | select_i(nan_mask(f), set1i(0x7E00u), nonsign));
}
#endif

// ---------------------------------------------------------------- both widths
MM_SIMD VF operator-(VF a) { return as_float(as_int(a) ^ set1i(0x80000000u)); }  // exact
MM_SIMD VF gt(VF a, VF b) { return lt(b, a); }

// dtype.h's f32_to_bf16: round to nearest even on the bits; NaN -> 0x7FC0.
MM_SIMD void store_bf16(uint16_t* p, VF f) {
  const VI u = as_int(f);
  const VI rounded = srli<16>(u + (srli<16>(u) & set1i(1u)) + set1i(0x7FFFu));
  store_u16(p, select_i(nan_mask(f), set1i(0x7FC0u), rounded));
}

}  // namespace simd
}  // namespace MM_ISA
}  // namespace metamat
