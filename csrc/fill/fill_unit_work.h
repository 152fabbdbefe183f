// What one thread does for one work unit (fill_units.h): Philox for the unit's 8 counters,
// the distribution's transform, and the stores (how a warp stages its units' stores is
// fill_warp_work.h). Shared by the CUDA kernel and the host emulation; they differ only in the
// policies that store bytes:
//   sink.vec<T, N>(addr, f)  N consecutive elements as aligned vector stores: N * size bytes,
//                            addr aligned to min(16, N * size) (16-byte stores, 8 for 4 x fp16)
//   sink.one<T>(addr, v)     one element
//   sink.philox(n)           n Philox calls were made (the emulation counts them)
//
// Two paths, chosen per unit:
//   interior: the unit's 32 columns lie inside the row and its first column is 16-byte aligned
//             (every aligned table's units but its edge blocks): all 8 lanes in one go (8
//             independent Philox chains per thread), then each word's 8 values as full
//             vectors (fp32 2 x 16 B, fp16/bf16 1 x 16 B, fp64 4 x 16 B);
//   edge:     row ends, narrow rows, unaligned starts or strides: the lanes in two halves of 4;
//             a half none of whose columns lies in the row computes nothing, a word none of
//             whose columns lies in the row is not transformed, and each 4-lane chunk is one
//             vector store when it is whole and aligned, else scalar stores.
#pragma once
#include <cstdint>
#include <type_traits>

#include "fill_units.h"
#include "metamat/fill_variant.h"
#include "metamat/philox.h"

namespace metamat {

// Element type tags.
struct F32 { static constexpr int kSize = 4; };
struct F16 { static constexpr int kSize = 2; };
struct BF16 { static constexpr int kSize = 2; };
struct F64 { static constexpr int kSize = 8; };

// The per-word values, written exactly as transform4 (philox.h) computes them.
MM_HD float uniform_value(const DistParams& d, uint32_t w) { return d.p0 + uniform01(w) * d.p1; }
MM_HD float trunc_normal_value(const DistParams& d, uint32_t w) {
  const float p = d.p2 + uniform01(w) * d.p3;
  float v = d.p0 + d.p1 * mm_erfinvf(p);
  v = v < d.clamp_lo ? d.clamp_lo : v;
  return v > d.clamp_hi ? d.clamp_hi : v;
}
template <DistKind K>
MM_HD float word_value(const DistParams& d, uint32_t w) {
  return K == DistKind::kUniform ? uniform_value(d, w) : trunc_normal_value(d, w);
}
MM_HD void normal_values(const DistParams& d, uint32_t w0, uint32_t w1, float* a, float* b) {
  float z0, z1;
  box_muller(w0, w1, &z0, &z1);
  *a = d.p0 + d.p1 * z0;
  *b = d.p0 + d.p1 * z1;
}

// The same values as a kernel variant computes them (fill_variant.h). kMode, from the segment's
// launch fields (fill_units.h variant_fields): kModeFold, the scale times 2^-24 is in
// LaunchInfo::scale, so a + u (b - a) with u = (x >> 8) 2^-24 is a + (x >> 8) ((b - a) 2^-24),
// the one rounding of the same real product; kModeCentral, erfinv's argument stays where its
// first polynomial is the result. The diagnostic `bits` stores the word itself.
constexpr int kModeFold = 1, kModeCentral = 2;
template <class Cfg, DistKind K, int kMode>
MM_HD float word_value_v(const Segment& s, uint32_t w) {
  const DistParams& d = s.dist;
  if constexpr (Cfg::bits && K == DistKind::kUniform) {
    return bits_to_float(w);
  } else if constexpr (K == DistKind::kUniform) {
    if constexpr ((kMode & kModeFold) != 0)
      return d.p0 + static_cast<float>(w >> 8) * bits_to_float(s.launch.scale);
    return uniform_value(d, w);
  } else if constexpr (!Cfg::math) {
    return trunc_normal_value(d, w);
  } else {
    const float p = (kMode & kModeFold) != 0
                        ? d.p2 + static_cast<float>(w >> 8) * bits_to_float(s.launch.scale)
                        : d.p2 + uniform01(w) * d.p3;
    float v = d.p0 + d.p1 * ((kMode & kModeCentral) != 0 ? mm_erfinvf_central(p) : mm_erfinvf(p));
    v = v < d.clamp_lo ? d.clamp_lo : v;
    return v > d.clamp_hi ? d.clamp_hi : v;
  }
}
template <class Cfg>
MM_HD void normal_values_v(const DistParams& d, uint32_t w0, uint32_t w1, float* a, float* b) {
  if constexpr (Cfg::math) {
    float z0, z1;
    box_muller_sel(w0, w1, &z0, &z1);
    *a = d.p0 + d.p1 * z0;
    *b = d.p0 + d.p1 * z1;
  } else {
    normal_values(d, w0, w1, a, b);
  }
}

// Philox's products as two instructions (variant `split`): ptxas fuses mul.hi and mul.lo of the
// same operands into one IMAD.WIDE.U32, so the low half multiplies by the multiplier read from
// constant memory (an operand ptxas cannot prove equal): IMAD.HI.U32 + IMAD. Same bits.
#if defined(__CUDACC__)
static __constant__ uint32_t kPhiloxMul[2] = {0xD2511F53u, 0xCD9E8D57u};
#endif
MM_HD uint32_t mulhilo_split(int which, uint32_t a, uint32_t* hi) {
  const uint32_t m = which == 0 ? 0xD2511F53u : 0xCD9E8D57u;
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, m);
  return a * kPhiloxMul[which];
#else
  return mulhilo(m, a, hi);
#endif
}

// Philox4x32-10 (philox.h) for N lanes (counters c0 .. c0+N-1 of one row), round by round:
// the lanes' chains are independent (the scheduler interleaves them) and share each round's
// key and, in round 1, the product of the row word. x[i][j] = word i of lane j.
template <int N, int kSplit = 0>
MM_HD void philox_lanes(const UnitPos& p, uint64_t key, uint32_t c0, uint32_t x[4][N]) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  uint32_t a[N], b[N], c[N], d[N];  // the counter words {c0 + j, r_lo, r_hi, c3}
  for (int j = 0; j < N; ++j) {
    a[j] = c0 + j;
    b[j] = p.r_lo;
    c[j] = p.r_hi;
    d[j] = p.c3;
  }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    for (int j = 0; j < N; ++j) {
      uint32_t hi0, hi1;
      const bool split = kSplit == 1 || (kSplit == 2 && j >= N / 2);
      const uint32_t lo0 = split ? mulhilo_split(0, a[j], &hi0) : mulhilo(M0, a[j], &hi0);
      const uint32_t lo1 = split ? mulhilo_split(1, c[j], &hi1) : mulhilo(M1, c[j], &hi1);
      a[j] = hi1 ^ b[j] ^ k0;
      c[j] = hi0 ^ d[j] ^ k1;
      b[j] = lo1;
      d[j] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int j = 0; j < N; ++j) {
    x[0][j] = a[j];
    x[1][j] = b[j];
    x[2][j] = c[j];
    x[3][j] = d[j];
  }
}

// Lanes j in [0, 8) with 0 <= c + j < cols, as bits.
MM_HD uint32_t lane_mask(int64_t c, int64_t cols) {
  const int64_t lo = c >= 0 ? 0 : (c <= -8 ? 8 : -c);
  const int64_t room = cols - c;
  const int64_t hi = room >= 8 ? 8 : (room <= 0 ? 0 : room);
  return hi <= lo ? 0u : ((1u << hi) - 1u) & ~((1u << lo) - 1u);
}

// One 4-lane chunk of one word at address a: lanes with bit j of m lie inside the row.
template <class T, class Sink>
MM_HD void store_chunk(Sink& out, uintptr_t a, const float f[4], uint32_t m) {
  constexpr uintptr_t kAlign = (4 * T::kSize < 16 ? 4 * T::kSize : 16) - 1;
  if (m == 15u && (a & kAlign) == 0) {
    out.template vec<T, 4>(a, f);
    return;
  }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < 4; ++j)
    if ((m >> j) & 1u) out.template one<T>(a + j * T::kSize, f[j]);
}

// Interior unit: a = address of lane 0, word 0 (16-byte aligned); all 32 columns in the row.
// kMode: the variant's per-segment shortcuts (word_value_v), chosen by interior_unit.
template <class Cfg, DistKind K, class T, int kMode, class Sink>
MM_HD void interior_unit_body(const Segment& s, const UnitPos& p, uintptr_t a, Sink& out) {
  const DistParams& d = s.dist;
  constexpr uintptr_t kWord = 8 * T::kSize;  // bytes between words
  float f[kLanes], g[kLanes];
  if constexpr (K == DistKind::kConstant) {
    for (int j = 0; j < kLanes; ++j) f[j] = d.p0;
    for (int i = 0; i < 4; ++i) out.template vec<T, kLanes>(a + i * kWord, f);
  } else {
    uint32_t x[4][kLanes];
    philox_lanes<kLanes, Cfg::split>(p, s.key, p.c0, x);
    out.philox(kLanes);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < 4; i += 2) {
      for (int j = 0; j < kLanes; ++j) {
        if constexpr (K == DistKind::kNormal) {
          normal_values_v<Cfg>(d, x[i][j], x[i + 1][j], &f[j], &g[j]);
        } else if constexpr (std::is_same_v<Cfg, CfgBase>) {
          f[j] = word_value<K>(d, x[i][j]);
          g[j] = word_value<K>(d, x[i + 1][j]);
        } else {
          f[j] = word_value_v<Cfg, K, kMode>(s, x[i][j]);
          g[j] = word_value_v<Cfg, K, kMode>(s, x[i + 1][j]);
        }
      }
      out.template vec<T, kLanes>(a + i * kWord, f);
      out.template vec<T, kLanes>(a + (i + 1) * kWord, g);
    }
  }
}

// Calls f(mode) with the variant's shortcuts for this segment as a compile-time kMode
// (block-uniform: one segment per tile); the plain kernel and other kinds always get 0.
template <class Cfg, DistKind K, class F>
MM_HD void with_mode(const Segment& s, F&& f) {
  if constexpr (Cfg::math && !Cfg::bits && K == DistKind::kUniform) {
    if (s.launch.flags & kFoldedScale) return f(std::integral_constant<int, kModeFold>{});
  } else if constexpr (Cfg::math && K == DistKind::kTruncNormal) {
    const uint32_t fl = s.launch.flags;
    if ((fl & kFoldedScale) && (fl & kErfinvCentral))
      return f(std::integral_constant<int, kModeFold | kModeCentral>{});
    if (fl & kFoldedScale) return f(std::integral_constant<int, kModeFold>{});
    if (fl & kErfinvCentral) return f(std::integral_constant<int, kModeCentral>{});
  }
  f(std::integral_constant<int, 0>{});
}

template <class Cfg, DistKind K, class T, class Sink>
MM_HD void interior_unit(const Segment& s, const UnitPos& p, uintptr_t a, Sink& out) {
  with_mode<Cfg, K>(s, [&](auto mode) {
    interior_unit_body<Cfg, K, T, decltype(mode)::value>(s, p, a, out);
  });
}

// Edge unit: lanes in two halves; only what lies inside the row is computed and stored.
template <class Cfg, DistKind K, class T, int kMode, class Sink>
MM_HD void edge_unit_body(const Segment& s, const UnitPos& p, uintptr_t a, Sink& out) {
  const DistParams& d = s.dist;
  constexpr uintptr_t kWord = 8 * T::kSize;
  uint32_t wm[4];  // lanes inside the row, per word
  for (int i = 0; i < 4; ++i) wm[i] = lane_mask(p.cb + 8 * i, s.cols);
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int h = 0; h < 2; ++h) {
    const int sh = 4 * h;
    const uint32_t m[4] = {(wm[0] >> sh) & 15u, (wm[1] >> sh) & 15u, (wm[2] >> sh) & 15u,
                           (wm[3] >> sh) & 15u};
    if ((m[0] | m[1] | m[2] | m[3]) == 0) continue;
    const uintptr_t ah = a + sh * T::kSize;
    float f[4], g[4];
    if constexpr (K == DistKind::kConstant) {
      for (int j = 0; j < 4; ++j) f[j] = d.p0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int i = 0; i < 4; ++i)
        if (m[i]) store_chunk<T>(out, ah + i * kWord, f, m[i]);
    } else {
      uint32_t x[4][4];
      philox_lanes<4, Cfg::split>(p, s.key, p.c0 + sh, x);
      out.philox(4);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int i = 0; i < 4; i += 2) {
        if ((m[i] | m[i + 1]) == 0) continue;
        if constexpr (K == DistKind::kNormal) {
          for (int j = 0; j < 4; ++j) normal_values_v<Cfg>(d, x[i][j], x[i + 1][j], &f[j], &g[j]);
        } else if constexpr (std::is_same_v<Cfg, CfgBase>) {
          if (m[i])
            for (int j = 0; j < 4; ++j) f[j] = word_value<K>(d, x[i][j]);
          if (m[i + 1])
            for (int j = 0; j < 4; ++j) g[j] = word_value<K>(d, x[i + 1][j]);
        } else {
          if (m[i])
            for (int j = 0; j < 4; ++j) f[j] = word_value_v<Cfg, K, kMode>(s, x[i][j]);
          if (m[i + 1])
            for (int j = 0; j < 4; ++j) g[j] = word_value_v<Cfg, K, kMode>(s, x[i + 1][j]);
        }
        if (m[i]) store_chunk<T>(out, ah + i * kWord, f, m[i]);
        if (m[i + 1]) store_chunk<T>(out, ah + (i + 1) * kWord, g, m[i + 1]);
      }
    }
  }
}

template <class Cfg, DistKind K, class T, class Sink>
MM_HD void edge_unit(const Segment& s, const UnitPos& p, uintptr_t a, Sink& out) {
  with_mode<Cfg, K>(s, [&](auto mode) {
    edge_unit_body<Cfg, K, T, decltype(mode)::value>(s, p, a, out);
  });
}

template <class Cfg, DistKind K, class T, class Sink>
MM_HD void run_unit(const Segment& s, int64_t u, Sink& out) {
  const UnitPos p = unit_pos<T::kSize>(s, u);
  const uintptr_t a = p.row + static_cast<uintptr_t>(p.cb * T::kSize);
  if (p.cb >= 0 && p.cb + 32 <= s.cols && (a & 15) == 0)
    interior_unit<Cfg, K, T>(s, p, a, out);
  else
    edge_unit<Cfg, K, T>(s, p, a, out);
}

// Thread `tid` of the block running tile `tile` (counted within segment s).
template <class Cfg, DistKind K, class T, class Sink>
MM_HD void run_thread(const Segment& s, int64_t tile, int tid, Sink& out) {
  const int64_t first = tile * kTile + tid;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const int64_t u = first + int64_t{k} * kTileThreads;
    if (u >= s.launch.units) return;
    run_unit<Cfg, K, T>(s, u, out);
  }
}

template <class Cfg, class T, class Sink>
MM_HD void run_thread_dist(const Segment& s, int64_t tile, int tid, Sink& out) {
  switch (static_cast<DistKind>(s.dist.kind)) {
    case DistKind::kUniform: return run_thread<Cfg, DistKind::kUniform, T>(s, tile, tid, out);
    case DistKind::kNormal: return run_thread<Cfg, DistKind::kNormal, T>(s, tile, tid, out);
    case DistKind::kTruncNormal:
      return run_thread<Cfg, DistKind::kTruncNormal, T>(s, tile, tid, out);
    case DistKind::kConstant: return run_thread<Cfg, DistKind::kConstant, T>(s, tile, tid, out);
  }
}

// Entry point of one thread: dtype and distribution are uniform over the block (one segment).
template <class Cfg, class Sink>
MM_HD void run_thread_any(const Segment& s, int64_t tile, int tid, Sink& out) {
  switch (static_cast<DType>(s.dtype)) {
    case DType::kFloat32: return run_thread_dist<Cfg, F32>(s, tile, tid, out);
    case DType::kFloat16: return run_thread_dist<Cfg, F16>(s, tile, tid, out);
    case DType::kBFloat16: return run_thread_dist<Cfg, BF16>(s, tile, tid, out);
    case DType::kFloat64: return run_thread_dist<Cfg, F64>(s, tile, tid, out);
    default: return;  // validated by prepare_launch
  }
}

}  // namespace metamat
