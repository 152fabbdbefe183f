// Work decomposition of the CUDA engine, shared by the kernel (fill_cuda.cu) and its host
// emulation (fill_emulate.cpp), so the GPU's indexing is tested on machines without a GPU.
//
//   launch -> tiles -> units -> lanes
//   * unit  = one 32-column block of one row: Philox counters 8b .. 8b+7 (lanes j = 0..7) give
//             words i = 0..3, and word i of lane j is column 32b + 8i + j (philox.h). One
//             thread runs a whole unit, so the 8 values of word i are 8 consecutive columns:
//             16-byte vector stores (fill_unit_work.h). Narrow rows (D < 32) have one unit per
//             row that skips the 4-lane halves and the words outside the row: D = 8 runs its 8
//             Philox calls but transforms word 0 only, D <= 4 runs 4 calls.
//   * tile  = kTile consecutive units of ONE segment, run by one thread block (thread t runs
//             units t, t + 256, ...). A segment has ceil(units / kTile) tiles; tiles of all
//             segments are numbered consecutively (LaunchInfo::tile_begin). Per-segment tiles
//             make every branch on dtype/distribution/index width block-uniform.
//   * block -> segment: a 256-ary search over tile_begin, one probe per thread per round
//             (__syncthreads_count), so 10,000 segments take 2 rounds, not 14 dependent loads.
// Index arithmetic is 64-bit except the unit -> (row, block) division, which uses a 32-bit
// multiply-shift when the segment has < 2^31 units (2^31 units are >= 8 GB even at D = 1, 256 GB
// of wide fp32 rows), and plain 64-bit division otherwise (LaunchFlags::kWideIndex).
#pragma once
#include <cstdint>
#include <string>

#include "metamat/check.h"
#include "metamat/fill.h"

namespace metamat {

constexpr int kTileThreads = 256;
constexpr int kUnitsPerThread = 4;
constexpr int64_t kTile = int64_t{kTileThreads} * kUnitsPerThread;  // units per thread block
constexpr int kLanes = 8;  // Philox counters per unit

enum LaunchFlags : uint32_t { kWideIndex = 1, kFoldedScale = 2, kErfinvCentral = 4 };

// What the kernel variants (fill_variant.h `math`) read from LaunchInfo:
// * kFoldedScale, scale: Uniform's b - a or TruncatedNormal's p3 times 2^-24, when that product
//   is exact (zero or a normal float): (x >> 8) * (scale 2^-24) is then the one rounding of the
//   same real product as ((x >> 8) 2^-24) * scale.
// * kErfinvCentral: TruncatedNormal whose erf-space interval [p2, p2 + p3] lies inside
//   (-0.99, 0.99): x = p2 + u p3 stays there (rounding is monotone), so erfinv's
//   w = -log((1 - x)(1 + x)) <= 3.92 < 5 and its result is always the first polynomial's
//   (the +-2 std truncations of trunc_normal_ have |x| <= 0.9545).
inline void variant_fields(Segment& s) {
  const DistKind k = static_cast<DistKind>(s.dist.kind);
  if (k != DistKind::kUniform && k != DistKind::kTruncNormal) return;
  const float src = k == DistKind::kUniform ? s.dist.p1 : s.dist.p3;
  const float folded = src * 5.9604644775390625e-8f;  // 2^-24
  const float mag = folded < 0.0f ? -folded : folded;
  if (src == 0.0f || (mag >= 1.17549435e-38f && folded * 16777216.0f == src)) {
    s.launch.flags |= kFoldedScale;
    s.launch.scale = float_to_bits(folded);
  }
  if (k == DistKind::kTruncNormal) {
    const double lo = s.dist.p2, hi = double(s.dist.p2) + double(s.dist.p3);
    const double a = lo < 0 ? -lo : lo, b = hi < 0 ? -hi : hi;
    if ((a > b ? a : b) < 0.99) s.launch.flags |= kErfinvCentral;
  }
}

// 32-column blocks that columns [col_offset, col_offset + cols) touch (cols >= 1).
MM_HD int64_t blocks_per_row(int64_t col_offset, int64_t cols) {
  return ((col_offset + cols - 1) >> 5) - (col_offset >> 5) + 1;
}

// n / d for n < 2^31, 1 <= d < 2^31, as (hi32(n * magic) + n) >> shift (Granlund-Montgomery;
// the divider of PyTorch's IntDivider).
inline void div_magic(uint32_t d, uint32_t* magic, uint32_t* shift) {
  uint32_t s = 0;
  while ((uint64_t{1} << s) < d) ++s;
  *shift = s;
  *magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1);
}
MM_HD uint32_t div_by_magic(uint32_t n, uint32_t magic, uint32_t shift) {
#if defined(__CUDA_ARCH__)
  const uint32_t hi = __umulhi(n, magic);
#else
  const uint32_t hi = static_cast<uint32_t>((uint64_t{n} * magic) >> 32);
#endif
  return (hi + n) >> shift;
}

struct LaunchPlan {
  int64_t segments = 0;  // non-empty segments in the table
  int64_t tiles = 0;     // thread blocks in all
};

// Validates `in` (the backstop behind Python's checks), copies its non-empty segments to
// `out` with their launch fields, and returns the plan. `out` may be `in`: segment i moves
// to index <= i only. `force_wide` sends every segment down the 64-bit index path (tests).
inline LaunchPlan prepare_launch(const Segment* in, int64_t n, Segment* out,
                                 bool force_wide = false) {
  LaunchPlan plan;
  // The message is built only for a bad segment (10,000 segments must cost microseconds).
  auto check = [](bool ok, int64_t i, const char* what) {
    if (!ok) fail(__FILE__, __LINE__, "segment " + std::to_string(i) + ": " + what);
  };
  for (int64_t i = 0; i < n; ++i) {
    Segment s = in[i];
    check(s.rows >= 0 && s.cols >= 0, i, "negative size");
    check(s.row_offset >= 0 && s.col_offset >= 0, i, "negative global offset");
    check(s.dtype >= int32_t(DType::kFloat32) && s.dtype <= int32_t(DType::kFloat64), i,
          "unknown dtype code");
    check(s.dist.kind >= 0 && s.dist.kind <= 3, i, "unknown distribution code");
    if (s.rows == 0 || s.cols == 0) continue;
    check(s.ptr != 0, i, "null pointer");
    check(s.rows == 1 || s.row_stride >= s.cols, i, "row stride smaller than cols");
    LaunchInfo& L = s.launch;
    L = LaunchInfo{};
    L.blocks_per_row = blocks_per_row(s.col_offset, s.cols);
    L.units = s.rows * L.blocks_per_row;
    L.tile_begin = plan.tiles;
    variant_fields(s);
    if (L.units < (int64_t{1} << 31) && !force_wide) {
      div_magic(static_cast<uint32_t>(L.blocks_per_row), &L.div_magic, &L.div_shift);
    } else {
      L.flags |= kWideIndex;
    }
    plan.tiles += (L.units + kTile - 1) / kTile;
    out[plan.segments++] = s;
  }
  return plan;
}

// ---- thread block -> segment: the last segment whose tile_begin <= tile -------------------
// Each round, thread t probes segment lo + t * step (kTileThreads probes cover [lo, hi]); the
// probes that hold form a prefix (tile_begin increases), so their count narrows [lo, hi] to
// one step. The kernel counts with __syncthreads_count, the emulation with a loop.
MM_HD int64_t search_step(int64_t lo, int64_t hi) {
  return (hi - lo + kTileThreads) / kTileThreads;  // ceil((hi - lo + 1) / kTileThreads)
}
MM_HD bool search_probe(const Segment* segs, int64_t lo, int64_t hi, int64_t step, int t,
                        int64_t tile) {
  const int64_t i = lo + t * step;
  return i <= hi && segs[i].launch.tile_begin <= tile;
}
// `count` >= 1: probe 0 (segment lo) always holds.
MM_HD void search_narrow(int64_t* lo, int64_t* hi, int64_t step, int count) {
  *lo += (count - 1) * step;
  const int64_t last = *lo + step - 1;
  *hi = last < *hi ? last : *hi;
}

// A block that runs several consecutive tiles (FillOptions::tiles_per_block) searches for its
// first tile's segment and then steps forward: every segment in the table has a tile, so one
// tile further is at most one segment further.
MM_HD int64_t advance_segment(const Segment* segs, int64_t nseg, int64_t lo, int64_t tile) {
  return (lo + 1 < nseg && segs[lo + 1].launch.tile_begin <= tile) ? lo + 1 : lo;
}

// ---- unit -> position ---------------------------------------------------------------------
struct UnitPos {
  uintptr_t row;         // address of local column 0 of the unit's row
  int64_t cb;            // local column of lane 0, word 0 (negative in a row's first block
                         // when col_offset is not a multiple of 32)
  uint32_t c0, c3;       // lane j's counter: {c0 + j, r_lo, r_hi, c3}
  uint32_t r_lo, r_hi;
};

// kNarrowOnly: the 32-bit division only (the SASS probes' per-unit count, scripts/).
template <int kElemSize, bool kNarrowOnly = false>
MM_HD UnitPos unit_pos(const Segment& s, int64_t u) {
  const LaunchInfo& L = s.launch;
  int64_t row, blk;
  if (kNarrowOnly || !(L.flags & kWideIndex)) {
    const uint32_t uu = static_cast<uint32_t>(u);
    const uint32_t q = div_by_magic(uu, L.div_magic, L.div_shift);
    row = q;
    blk = uu - q * static_cast<uint32_t>(L.blocks_per_row);
  } else {
    row = u / L.blocks_per_row;
    blk = u - row * L.blocks_per_row;
  }
  const int64_t gb = (s.col_offset >> 5) + blk;  // global 32-column block
  const uint64_t g0 = static_cast<uint64_t>(gb) * 8;
  const uint64_t gr = static_cast<uint64_t>(s.row_offset + row);
  UnitPos p;
  p.row = static_cast<uintptr_t>(s.ptr) +
          static_cast<uintptr_t>(row * s.row_stride * kElemSize);
  p.cb = gb * 32 - s.col_offset;
  p.c0 = static_cast<uint32_t>(g0);  // lanes never carry: g0 is a multiple of 8
  p.c3 = static_cast<uint32_t>(g0 >> 32);
  p.r_lo = static_cast<uint32_t>(gr);
  p.r_hi = static_cast<uint32_t>(gr >> 32);
  return p;
}

}  // namespace metamat
