// The CPU fill kernel, compiled once per instruction set (fill_cpu_{avx512,avx2,base}.cpp
// include this with MM_ISA set and their own -m flags; fill_cpu.cpp picks one at run time).
//
// A pass makes 64 consecutive columns of one row: 16 Philox counters (two 32-column blocks),
// taken kW at a time (a "group": 8 lanes with AVX2, 4 with SSE2). Word i of group j is the
// kW consecutive columns 32 * (kW*j / 8) + 8 * i + (kW*j) % 8 (see philox.h), so each
// transformed lane vector is stored straight into the destination row, converted to its type.
// The AVX-512 build takes all 16 counters as one group (kW = 16): word i holds columns
// 8i..8i+7 and 32+8i..32+8i+7, so two words' values are regrouped by halves before the
// stores (put_words). All transforms are simd_math.h: bit-identical to philox.h.
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
static_assert(kW == 16 || kGroups % 2 == 0, "a pass is processed two groups at a time");

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)  // simd_vec.h: 16 lanes
#define MM_KERNEL_16_LANES 1
static_assert(kW == 16, "the AVX-512 build has 16 lanes");
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

#ifdef MM_KERNEL_16_LANES
// The transformed words t0..t3 of the pass's 16 counters (t_i: columns 8i + lane for lanes
// 0-7, 32 + 8i + lane - 8 for lanes 8-15) into out[0..64) in column order.
template <DType D>
MM_SIMD void put_words(typename Elem<D>::T* out, VF t0, VF t1, VF t2, VF t3) {
  put<D>(out, 0, low_halves(t0, t1));
  put<D>(out, 16, low_halves(t2, t3));
  put<D>(out, 32, high_halves(t0, t1));
  put<D>(out, 48, high_halves(t2, t3));
}

// The 64 values of global columns [64p, 64p + 64) of the row `pr` was made for, as type D,
// at out[0..64).
template <DistKind K, DType D>
inline void generate_pass(const SegCtx& ctx, const PhiloxRow& pr, uint64_t p,
                          typename Elem<D>::T* out) {
  if constexpr (K == DistKind::kConstant) {
    for (int c = 0; c < kPass; c += kW) put<D>(out, c, ctx.d.p0);
  } else {
    // the AVX2 kernel's Philox at 16 lanes: ~1.2x faster Uniform than the plain 10-round
    // 512-bit Philox this build had (its lane-uniform first rounds and even/odd split)
    VI w[4];
    philox_lanes(ctx.k, pr, static_cast<uint32_t>(p * 16), static_cast<uint32_t>(p * 16 >> 32),
                 w);
    if constexpr (K == DistKind::kUniform) {
      put_words<D>(out, uniform(ctx.d, PI<1>{w[0]}).a, uniform(ctx.d, PI<1>{w[1]}).a,
                   uniform(ctx.d, PI<1>{w[2]}).a, uniform(ctx.d, PI<1>{w[3]}).a);
    } else if constexpr (K == DistKind::kNormal) {
      // Box-Muller pairs (word 0, word 1) and (word 2, word 3), two vectors in lockstep
      PF<2> v0, v1;
      normal(ctx.d, PI<2>{w[0], w[2]}, PI<2>{w[1], w[3]}, &v0, &v1);
      put_words<D>(out, v0.a, v1.a, v0.b, v1.b);
    } else {
      const PF<4> v = trunc_normal(ctx.d, PI<4>{w[0], w[1], w[2], w[3]});
      put_words<D>(out, v.a, v.b, v.c, v.d);
    }
  }
}
// Whole passes p and p + 1 of one row (out[0..128)) of the long transforms: twice one pass's
// independent chains (Normal: four Box-Muller vectors instead of two, TruncatedNormal: eight
// erfinv vectors instead of four), each ~1.2x faster per core on the Xeon.
template <DistKind K, DType D>
inline void two_passes(const SegCtx& ctx, const PhiloxRow& pr, uint64_t p,
                       typename Elem<D>::T* out) {
  VI w[4], x[4];
  philox_lanes(ctx.k, pr, static_cast<uint32_t>(p * 16), static_cast<uint32_t>(p * 16 >> 32), w);
  philox_lanes(ctx.k, pr, static_cast<uint32_t>((p + 1) * 16),
               static_cast<uint32_t>((p + 1) * 16 >> 32), x);
  if constexpr (K == DistKind::kNormal) {
    PF<4> v0, v1;
    normal(ctx.d, PI<4>{w[0], w[2], x[0], x[2]}, PI<4>{w[1], w[3], x[1], x[3]}, &v0, &v1);
    put_words<D>(out, v0.a, v1.a, v0.b, v1.b);
    put_words<D>(out + kPass, v0.c, v1.c, v0.d, v1.d);
  } else {
    static_assert(K == DistKind::kTruncNormal, "two passes: the long transforms only");
    const PF<4> v = trunc_normal(ctx.d, PI<4>{w[0], w[1], w[2], w[3]});
    const PF<4> u = trunc_normal(ctx.d, PI<4>{x[0], x[1], x[2], x[3]});
    put_words<D>(out, v.a, v.b, v.c, v.d);
    put_words<D>(out + kPass, u.a, u.b, u.c, u.d);
  }
}
#else
// The 64 values of global columns [64p, 64p + 64) of the row `pr` was made for, as type D,
// at out[0..64).
template <DistKind K, DType D>
inline void generate_pass(const SegCtx& ctx, const PhiloxRow& pr, uint64_t p,
                          typename Elem<D>::T* out) {
  if constexpr (K == DistKind::kConstant) {
    for (int c = 0; c < kPass; c += kW) put<D>(out, c, ctx.d.p0);
    return;
  } else {
    const uint64_t g0 = p * 16;  // first counter of the pass (blocks 2p, 2p + 1)
    // Word i of group j holds columns col(j) + 8i .. col(j) + 8i + kW - 1.
    auto col = [](int j) { return 32 * (kW * j / 8) + (kW * j) % 8; };
    auto philox = [&](int j, VI w[4]) {
      philox_lanes(ctx.k, pr, static_cast<uint32_t>(g0) + kW * j,
                   static_cast<uint32_t>(g0 >> 32), w);
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
#endif

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
#ifdef MM_KERNEL_16_LANES
    if constexpr (K == DistKind::kNormal || K == DistKind::kTruncNormal) {
      if (first == 0 && gc_end - gc >= 2 * kPass) {
        two_passes<K, D>(ctx, pr, p, dst);
        gc += 2 * kPass;
        continue;
      }
    }
#endif
    if (n == kPass) {
      generate_pass<K, D>(ctx, pr, p, dst);
    } else {
      alignas(64) T buf[kPass];
      generate_pass<K, D>(ctx, pr, p, buf);
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
