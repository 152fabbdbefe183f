// The CPU fill kernel, compiled once per instruction set (fill_cpu_{avx512,avx2,base}.cpp
// include this with MM_ISA set and their own -m flags; fill_cpu.cpp picks one at run time).
//
// A pass makes 64 consecutive columns of one row: 16 Philox counters (two 32-column blocks),
// taken kW at a time (a "group": 8 lanes with AVX2, 4 with SSE2). Word i of group j is the
// kW consecutive columns 32 * (kW*j / 8) + 8 * i + (kW*j) % 8 (see philox.h), so each
// transformed lane vector is stored straight into the destination row, converted to its type.
// The AVX-512 build keeps its 16-lane Philox (512-bit multiplies) and runs the transforms on
// 8-lane AVX2 vectors. All transforms are simd_math.h: bit-identical to philox.h.
#include <algorithm>
#include <cstring>

#include "fill_cpu.h"

#ifndef MM_ISA
#error "define MM_ISA before including fill_cpu_kernel.h"
#endif

#include "simd_math.h"
#include "simd_philox.h"

namespace metamat {
namespace MM_ISA {

using namespace simd;

constexpr int kPass = 64;         // columns per pass
constexpr int kGroups = 16 / kW;  // lane groups of Philox counters per pass
constexpr int kN = 4;             // vectors in lockstep in the long transforms (simd_pack.h)
static_assert(kGroups % 2 == 0, "a pass is processed two groups at a time");

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Philox4x32-10 on the 16 counters g0 .. g0+15 (g0 a multiple of 16: one high word).
inline void philox16(uint64_t g0, uint32_t r_lo, uint32_t r_hi, uint32_t k0, uint32_t k1,
                     uint32_t x[4][16]) {
  __m512i c0 = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(g0))),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i c1 = _mm512_set1_epi32(r_lo), c2 = _mm512_set1_epi32(r_hi);
  __m512i c3 = _mm512_set1_epi32(static_cast<uint32_t>(g0 >> 32));
  const __m512i m0 = _mm512_set1_epi32(0xD2511F53u), m1 = _mm512_set1_epi32(0xCD9E8D57u);
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
  _mm512_storeu_si512(x[0], c0);
  _mm512_storeu_si512(x[1], c1);
  _mm512_storeu_si512(x[2], c2);
  _mm512_storeu_si512(x[3], c3);
}
#endif

// What every row of a segment span shares: distribution constants and round keys.
struct SegCtx {
  Params d;
  PhiloxKey k;
  explicit SegCtx(const Segment& s) : d(s.dist), k(s.key) {}
};

template <DType D> struct Elem;
template <> struct Elem<DType::kFloat32> { using T = float; };
template <> struct Elem<DType::kFloat16> { using T = uint16_t; };
template <> struct Elem<DType::kBFloat16> { using T = uint16_t; };
template <> struct Elem<DType::kFloat64> { using T = double; };

// Lane vector v -> elements out[col .. col + kW) of type D.
template <DType D>
MM_SIMD void put(typename Elem<D>::T* out, int col, VF v) {
  if constexpr (D == DType::kFloat32) store_f32(out + col, v);
  else if constexpr (D == DType::kFloat16) store_f16(out + col, v);
  else if constexpr (D == DType::kBFloat16) store_bf16(out + col, v);
  else store_f64(out + col, v);
}

// The 64 values of global columns [64p, 64p + 64) of global row `row`, as type D, at out[0..64).
template <DistKind K, DType D>
inline void generate_pass(const SegCtx& ctx, [[maybe_unused]] const PhiloxRow& pr,
                          [[maybe_unused]] uint64_t row, uint64_t p,
                          typename Elem<D>::T* out) {
  if constexpr (K == DistKind::kConstant) {
    for (int c = 0; c < kPass; c += kW) put<D>(out, c, ctx.d.p0);
    return;
  } else {
    const uint64_t g0 = p * 16;  // first counter of the pass (blocks 2p, 2p + 1)
#if defined(__AVX512F__) && defined(__AVX512BW__)
    alignas(64) uint32_t x[4][16];
    philox16(g0, static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32), ctx.k.k0[0],
             ctx.k.k1[0], x);
#endif
    // Word i of group j holds columns col(j) + 8i .. col(j) + 8i + kW - 1.
    auto col = [](int j) { return 32 * (kW * j / 8) + (kW * j) % 8; };
    auto philox = [&](int j, VI w[4]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (int i = 0; i < 4; ++i) w[i] = load_i(x[i] + kW * j);
#else
      philox_lanes(ctx.k, pr, static_cast<uint32_t>(g0) + kW * j,
                   static_cast<uint32_t>(g0 >> 32), w);
#endif
    };
    if constexpr (K == DistKind::kUniform) {  // short transform: group by group
      for (int j = 0; j < kGroups; ++j) {
        VI w[4];
        philox(j, w);
        for (int i = 0; i < 4; ++i) put<D>(out, col(j) + 8 * i, uniform(ctx.d, PI<1>{w[i]}).a);
      }
      return;
    }
    // Long transforms: all Philox words of the pass first, then four vectors in lockstep
    // (simd_pack.h), so independent chains sit back to back and the core stays busy.
    // Unrolled: as a loop, GCC copied the 20 round-key vectors to the stack on every pass
    // (Normal ~1.1x faster unrolled, together with box_muller's interleaving).
    VI w[kGroups][4];
#pragma GCC unroll 4
    for (int j = 0; j < kGroups; ++j) philox(j, w[j]);
    for (int j = 0; j < kGroups; j += 2) {  // groups j, j + 1
      if constexpr (K == DistKind::kNormal) {
        // Box-Muller pairs (word 0, word 1) and (word 2, word 3) of both groups.
        PF<4> v0, v1;
        normal(ctx.d, PI<4>{w[j][0], w[j][2], w[j + 1][0], w[j + 1][2]},
               PI<4>{w[j][1], w[j][3], w[j + 1][1], w[j + 1][3]}, &v0, &v1);
        put<D>(out, col(j), v0.a);
        put<D>(out, col(j) + 8, v1.a);
        put<D>(out, col(j) + 16, v0.b);
        put<D>(out, col(j) + 24, v1.b);
        put<D>(out, col(j + 1), v0.c);
        put<D>(out, col(j + 1) + 8, v1.c);
        put<D>(out, col(j + 1) + 16, v0.d);
        put<D>(out, col(j + 1) + 24, v1.d);
      } else {
        for (int h = 0; h < 2; ++h) {
          const VI* wh = w[j + h];
          const PF<4> v = trunc_normal(ctx.d, PI<4>{wh[0], wh[1], wh[2], wh[3]});
          put<D>(out, col(j + h), v.a);
          put<D>(out, col(j + h) + 8, v.b);
          put<D>(out, col(j + h) + 16, v.c);
          put<D>(out, col(j + h) + 24, v.d);
        }
      }
    }
  }
}

// Columns [c_begin, c_end) (local) of local row r of one segment: whole passes go straight
// into the row, the partial ones at the ends through a small buffer.
template <DistKind K, DType D>
inline void fill_row(const SegCtx& ctx, const Segment& s, int64_t r, int64_t c_begin,
                     int64_t c_end) {
  using T = typename Elem<D>::T;
  T* row = reinterpret_cast<T*>(s.ptr) + r * s.row_stride;
  const uint64_t gr = static_cast<uint64_t>(s.row_offset + r);
  const PhiloxRow pr(ctx.k, gr);
  int64_t gc = s.col_offset + c_begin;  // next global column to write
  const int64_t gc_end = s.col_offset + c_end;
  while (gc < gc_end) {
    const uint64_t p = static_cast<uint64_t>(gc) / kPass;
    const int64_t first = gc - static_cast<int64_t>(p * kPass);
    const int64_t n = std::min<int64_t>(kPass - first, gc_end - gc);
    T* dst = row + (gc - s.col_offset);
    if (n == kPass) {
      generate_pass<K, D>(ctx, pr, gr, p, dst);
    } else {
      alignas(64) T buf[kPass];
      generate_pass<K, D>(ctx, pr, gr, p, buf);
      std::memcpy(dst, buf + first, n * sizeof(T));
    }
    gc += n;
  }
}

// Elements [begin, end) of the segment in row-major order (rows of s.cols elements).
template <DistKind K, DType D>
void fill_span_typed(const Segment& s, int64_t begin, int64_t end) {
  const SegCtx ctx(s);
  int64_t r = begin / s.cols, c = begin % s.cols;
  while (begin < end) {
    const int64_t n = std::min(s.cols - c, end - begin);
    fill_row<K, D>(ctx, s, r, c, c + n);
    begin += n;
    ++r;
    c = 0;
  }
}

template <DistKind K>
void fill_span_kind(const Segment& s, int64_t begin, int64_t end) {
  switch (static_cast<DType>(s.dtype)) {
    case DType::kFloat32: return fill_span_typed<K, DType::kFloat32>(s, begin, end);
    case DType::kFloat16: return fill_span_typed<K, DType::kFloat16>(s, begin, end);
    case DType::kBFloat16: return fill_span_typed<K, DType::kBFloat16>(s, begin, end);
    case DType::kFloat64: return fill_span_typed<K, DType::kFloat64>(s, begin, end);
    default: return;  // validated by the caller (fill_cpu)
  }
}

// Elements [begin, end) (row-major offsets, 0 <= begin < end <= rows * cols) of one segment.
void fill_span(const Segment& s, int64_t begin, int64_t end) {
  if (begin >= end) return;
  switch (static_cast<DistKind>(s.dist.kind)) {
    case DistKind::kUniform: return fill_span_kind<DistKind::kUniform>(s, begin, end);
    case DistKind::kNormal: return fill_span_kind<DistKind::kNormal>(s, begin, end);
    case DistKind::kTruncNormal: return fill_span_kind<DistKind::kTruncNormal>(s, begin, end);
    case DistKind::kConstant: return fill_span_kind<DistKind::kConstant>(s, begin, end);
  }
}

// Test hook (tests/test_simd_math.py): run one simd_math.h function over n inputs, kN
// vectors at a time as the kernel does. Every element goes through the lane code (the tail
// is padded), so tails are checked too.
void math_apply(MathFn fn, const void* in, void* out, int64_t n) {
  constexpr int kStep = kN * kW;
  const bool pairs = fn == MathFn::kBoxMuller;
  const uint32_t* iu = static_cast<const uint32_t*>(in);
  float* of = static_cast<float*>(out);
  uint16_t* oh = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; i += kStep) {
    const int m = static_cast<int>(std::min<int64_t>(kStep, n - i));
    alignas(64) uint32_t a[kStep] = {}, b[kStep] = {};
    alignas(64) float r0[kStep] = {}, r1[kStep] = {};
    alignas(64) uint16_t h[kStep] = {};
    for (int l = 0; l < m; ++l) {
      a[l] = iu[pairs ? 2 * (i + l) : i + l];
      if (pairs) b[l] = iu[2 * (i + l) + 1];
    }
    const PI<kN> xa = make<PI, kN>([&](int v) { return load_i(a + kW * v); });
    const PI<kN> xb = make<PI, kN>([&](int v) { return load_i(b + kW * v); });
    PF<kN> y0 = as_float(xa), y1 = y0;
    switch (fn) {
      case MathFn::kLog: y0 = logf(y0); break;
      case MathFn::kErfinv: y0 = erfinvf(y0); break;
      case MathFn::kSinCos: sincos_word(xa, &y0, &y1); break;
      case MathFn::kBoxMuller: box_muller(xa, xb, &y0, &y1); break;
      case MathFn::kToF16:
        for (int v = 0; v < kN; ++v) store_f16(h + kW * v, y0[v]);
        break;
      case MathFn::kToBF16:
        for (int v = 0; v < kN; ++v) store_bf16(h + kW * v, y0[v]);
        break;
    }
    for (int v = 0; v < kN; ++v) {
      store_f32(r0 + kW * v, y0[v]);
      store_f32(r1 + kW * v, y1[v]);
    }
    for (int l = 0; l < m; ++l) {
      if (fn == MathFn::kToF16 || fn == MathFn::kToBF16) {
        oh[i + l] = h[l];
      } else if (fn == MathFn::kSinCos || pairs) {
        of[2 * (i + l)] = r0[l];
        of[2 * (i + l) + 1] = r1[l];
      } else {
        of[i + l] = r0[l];
      }
    }
  }
}

}  // namespace MM_ISA
}  // namespace metamat
