// The CPU fill kernel, compiled once per instruction set (fill_cpu_{avx512,avx2,base}.cpp
// include this with MM_ISA set and their own -m flags; fill_cpu.cpp picks one at run time).
// A pass computes 16 Philox counters = two 32-column blocks = 64 consecutive columns, with
// explicit SIMD for Philox and lane loops the compiler vectorises for the transforms.
#include <algorithm>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fill.h"
#include "float_convert.h"

#ifndef MM_ISA
#error "define MM_ISA before including fill_cpu_kernel.h"
#endif

namespace metamat {
namespace MM_ISA {

constexpr int kLanes = 16;  // counters per pass: blocks b and b+1, 8 counters each
constexpr int kPass = 64;   // columns per pass

// Philox4x32-10 on 16 counters {base + (l & 7) + 8 * (l >> 3) ... } laid out as two blocks.
inline void philox16(const uint64_t g[kLanes], uint32_t r_lo, uint32_t r_hi, uint32_t k0,
                     uint32_t k1, uint32_t x[4][kLanes]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i c0 = _mm512_set_epi32(
      (uint32_t)g[15], (uint32_t)g[14], (uint32_t)g[13], (uint32_t)g[12], (uint32_t)g[11],
      (uint32_t)g[10], (uint32_t)g[9], (uint32_t)g[8], (uint32_t)g[7], (uint32_t)g[6],
      (uint32_t)g[5], (uint32_t)g[4], (uint32_t)g[3], (uint32_t)g[2], (uint32_t)g[1],
      (uint32_t)g[0]);
  __m512i c1 = _mm512_set1_epi32(r_lo), c2 = _mm512_set1_epi32(r_hi);
  __m512i c3 = _mm512_set1_epi32(static_cast<uint32_t>(g[0] >> 32));
  // Both blocks share g >> 32 unless they straddle 2^32 counters; fix the rare lane after.
  const __m512i m0 = _mm512_set1_epi32(0xD2511F53u), m1 = _mm512_set1_epi32(0xCD9E8D57u);
  if ((g[0] >> 32) != (g[15] >> 32)) {
    alignas(64) uint32_t hi[kLanes];
    for (int l = 0; l < kLanes; ++l) hi[l] = static_cast<uint32_t>(g[l] >> 32);
    c3 = _mm512_load_si512(hi);
  }
  for (int i = 0; i < 10; ++i) {
    __m512i k0v = _mm512_set1_epi32(k0), k1v = _mm512_set1_epi32(k1);
    // 32x32->64 products of even and odd lanes; hi and lo halves regrouped by one shift and
    // one masked move each (cheaper than mullo_epi32); xor3 in one ternary-logic op.
    __m512i pe0 = _mm512_mul_epu32(c0, m0), po0 = _mm512_mul_epu32(_mm512_srli_epi64(c0, 32), m0);
    __m512i pe1 = _mm512_mul_epu32(c2, m1), po1 = _mm512_mul_epu32(_mm512_srli_epi64(c2, 32), m1);
    __m512i hi0 = _mm512_mask_mov_epi32(_mm512_srli_epi64(pe0, 32), 0xAAAA, po0);
    __m512i hi1 = _mm512_mask_mov_epi32(_mm512_srli_epi64(pe1, 32), 0xAAAA, po1);
    __m512i lo0 = _mm512_mask_mov_epi32(pe0, 0xAAAA, _mm512_slli_epi64(po0, 32));
    __m512i lo1 = _mm512_mask_mov_epi32(pe1, 0xAAAA, _mm512_slli_epi64(po1, 32));
    c0 = _mm512_ternarylogic_epi32(hi1, c1, k0v, 0x96);
    c2 = _mm512_ternarylogic_epi32(hi0, c3, k1v, 0x96);
    c1 = lo1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm512_store_si512(x[0], c0);
  _mm512_store_si512(x[1], c1);
  _mm512_store_si512(x[2], c2);
  _mm512_store_si512(x[3], c3);
#elif defined(__AVX2__)
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  for (int h = 0; h < 2; ++h) {
    alignas(32) uint32_t lo_g[8], hi_g[8];
    for (int l = 0; l < 8; ++l) {
      lo_g[l] = static_cast<uint32_t>(g[8 * h + l]);
      hi_g[l] = static_cast<uint32_t>(g[8 * h + l] >> 32);
    }
    __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo_g));
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(r_lo));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(r_hi));
    __m256i c3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi_g));
    uint32_t a = k0, b = k1;
    for (int i = 0; i < 10; ++i) {
      __m256i k0v = _mm256_set1_epi32(static_cast<int>(a));
      __m256i k1v = _mm256_set1_epi32(static_cast<int>(b));
      __m256i pe0 = _mm256_mul_epu32(c0, m0), po0 = _mm256_mul_epu32(_mm256_srli_epi64(c0, 32), m0);
      __m256i pe1 = _mm256_mul_epu32(c2, m1), po1 = _mm256_mul_epu32(_mm256_srli_epi64(c2, 32), m1);
      __m256i hi0 = _mm256_blend_epi32(_mm256_srli_epi64(pe0, 32), po0, 0xAA);
      __m256i hi1 = _mm256_blend_epi32(_mm256_srli_epi64(pe1, 32), po1, 0xAA);
      __m256i lo0 = _mm256_mullo_epi32(c0, m0), lo1 = _mm256_mullo_epi32(c2, m1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), k0v);
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), k1v);
      c1 = lo1;
      c3 = lo0;
      a += 0x9E3779B9u;
      b += 0xBB67AE85u;
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(x[0] + 8 * h), c0);
    _mm256_store_si256(reinterpret_cast<__m256i*>(x[1] + 8 * h), c1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(x[2] + 8 * h), c2);
    _mm256_store_si256(reinterpret_cast<__m256i*>(x[3] + 8 * h), c3);
  }
#else
  for (int l = 0; l < kLanes; ++l) {
    Philox4 w = philox4x32_10(static_cast<uint32_t>(g[l]), r_lo, r_hi,
                              static_cast<uint32_t>(g[l] >> 32), k0, k1);
    for (int i = 0; i < 4; ++i) x[i][l] = w.v[i];
  }
#endif
}

// 64 float32 values of global columns [64*p, 64*p + 64) of global row r (p = pass index).
template <DistKind K>
inline void generate_pass(const DistParams& d, uint64_t key, uint64_t r, uint64_t p,
                          float* __restrict out) {
  alignas(64) uint64_t g[kLanes];
  for (int l = 0; l < kLanes; ++l) g[l] = p * 16 + static_cast<uint64_t>(l);  // blocks 2p, 2p+1
  alignas(64) uint32_t x[4][kLanes];
  philox16(g, static_cast<uint32_t>(r), static_cast<uint32_t>(r >> 32),
           static_cast<uint32_t>(key), static_cast<uint32_t>(key >> 32), x);
  alignas(64) float f[4][kLanes];
  if constexpr (K == DistKind::kUniform) {
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < kLanes; ++l) f[i][l] = d.p0 + uniform01(x[i][l]) * d.p1;
  } else if constexpr (K == DistKind::kNormal) {
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < kLanes; ++l) {
        float z0, z1;
        box_muller(x[2 * h][l], x[2 * h + 1][l], &z0, &z1);
        f[2 * h][l] = d.p0 + d.p1 * z0;
        f[2 * h + 1][l] = d.p0 + d.p1 * z1;
      }
  } else {
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < kLanes; ++l) {
        float q = d.p2 + uniform01(x[i][l]) * d.p3;
        float v = d.p0 + d.p1 * mm_erfinvf(q);
        v = v < d.clamp_lo ? d.clamp_lo : v;
        f[i][l] = v > d.clamp_hi ? d.clamp_hi : v;
      }
  }
  // Lane l of word i is column 32*(l/8) + 8*i + l%8: copy 8-float runs into column order.
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) std::memcpy(out + 32 * h + 8 * i, &f[i][8 * h], 8 * sizeof(float));
}

inline void store(DType t, char* row, int64_t i, const float* src, int64_t n) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(reinterpret_cast<float*>(row) + i, src, n * sizeof(float));
      break;
    case DType::kFloat16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(row) + i;
      int64_t k = 0;
#if defined(__F16C__)
      for (; k + 8 <= n; k += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + k), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; k < n; ++k) o[k] = to_half_bits(src[k]);
      break;
    }
    case DType::kBFloat16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(row) + i;
      for (int64_t k = 0; k < n; ++k) o[k] = to_bf16_bits(src[k]);
      break;
    }
    case DType::kFloat64: {
      double* o = reinterpret_cast<double*>(row) + i;
      for (int64_t k = 0; k < n; ++k) o[k] = src[k];
      break;
    }
  }
}

inline int64_t element_size(DType t) {
  return t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2;
}

template <DistKind K>
void fill_piece(const Segment& s, int64_t r, int64_t c_begin, int64_t c_end) {
  const DType t = static_cast<DType>(s.dtype);
  char* row = reinterpret_cast<char*>(s.ptr) + r * s.row_stride * element_size(t);
  alignas(64) float buf[kPass];
  if constexpr (K == DistKind::kConstant) {
    std::fill(buf, buf + kPass, s.dist.p0);
    for (int64_t c = c_begin; c < c_end; c += kPass)
      store(t, row, c, buf, std::min<int64_t>(kPass, c_end - c));
  } else {
    const uint64_t gr = static_cast<uint64_t>(s.row_offset + r);
    int64_t gc = s.col_offset + c_begin;  // next global column to write
    const int64_t gc_end = s.col_offset + c_end;
    while (gc < gc_end) {
      const uint64_t p = static_cast<uint64_t>(gc) / kPass;
      generate_pass<K>(s.dist, s.key, gr, p, buf);
      const int64_t first = gc - static_cast<int64_t>(p * kPass);
      const int64_t n = std::min<int64_t>(kPass - first, gc_end - gc);
      store(t, row, gc - s.col_offset, buf + first, n);
      gc += n;
    }
  }
}

// Columns [c0, c1) (local) of local row r of one segment.
void fill_range(const Segment& s, int64_t r, int64_t c0, int64_t c1) {
  switch (static_cast<DistKind>(s.dist.kind)) {
    case DistKind::kUniform: return fill_piece<DistKind::kUniform>(s, r, c0, c1);
    case DistKind::kNormal: return fill_piece<DistKind::kNormal>(s, r, c0, c1);
    case DistKind::kTruncNormal: return fill_piece<DistKind::kTruncNormal>(s, r, c0, c1);
    case DistKind::kConstant: return fill_piece<DistKind::kConstant>(s, r, c0, c1);
  }
}

}  // namespace MM_ISA
}  // namespace metamat
