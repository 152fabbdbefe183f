// Work decomposition of the CUDA engine, shared by the kernel (fill_cuda.cu) and its host
// emulation (fill_emulate.cpp), so the GPU's indexing is tested on machines without a GPU.
//
// Work unit = one Philox counter of one row: columns 32*(g/8) + 8*i + g%8, i = 0..3 (see
// philox.h). Units of all segments are numbered consecutively (Segment::unit_begin); a tile
// of kTile units goes to one thread block, which finds the segments it touches by binary
// search over unit_begin.
#pragma once
#include <vector>

#include "fill.h"

namespace metamat {

constexpr int kTileThreads = 256;
constexpr int kUnitsPerThread = 4;
constexpr int64_t kTile = int64_t{kTileThreads} * kUnitsPerThread;

// Philox counters per row: 8 per 32-column block the segment's columns touch.
MM_HD int64_t counters_per_row(const Segment& s) {
  return 8 * (((s.col_offset + s.cols - 1) >> 5) - (s.col_offset >> 5) + 1);
}

// Index of the last segment in [lo, hi] whose unit_begin <= u.
MM_HD int64_t find_segment(const Segment* segs, int64_t lo, int64_t hi, int64_t u) {
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].unit_begin <= u) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Number the units of non-empty segments (empty ones are dropped); returns the total.
inline int64_t assign_units(std::vector<Segment>& segs) {
  std::vector<Segment> kept;
  kept.reserve(segs.size());
  int64_t units = 0;
  for (Segment s : segs) {
    if (s.rows <= 0 || s.cols <= 0) continue;
    s.unit_begin = units;
    units += s.rows * counters_per_row(s);
    kept.push_back(s);
  }
  segs.swap(kept);
  return units;
}

// What unit u writes: segment, local row, the local column of word 0 (word i at +8*i, kept
// where 0 <= c < cols), and the four float32 values.
struct UnitWork {
  const Segment* seg;
  int64_t row;
  int64_t c_first;
  float v[4];
};

MM_HD void compute_unit(const Segment* segs, int64_t lo, int64_t hi, int64_t u, UnitWork* w) {
  const int64_t si = lo == hi ? lo : find_segment(segs, lo, hi, u);
  const Segment& s = segs[si];
  const int64_t ngr = counters_per_row(s);
  const int64_t local = u - s.unit_begin;
  // 32-bit division when it fits (the common case): 64-bit division is emulated on GPUs.
  const int64_t row = (local >> 32) == 0 && (ngr >> 32) == 0
                          ? static_cast<int64_t>(static_cast<uint32_t>(local) /
                                                 static_cast<uint32_t>(ngr))
                          : local / ngr;
  const uint64_t g = static_cast<uint64_t>((s.col_offset >> 5) * 8 + (local - row * ngr));
  const uint64_t gr = static_cast<uint64_t>(s.row_offset + row);
  if (s.dist.kind == static_cast<int32_t>(DistKind::kConstant)) {
    w->v[0] = w->v[1] = w->v[2] = w->v[3] = s.dist.p0;
  } else {
    Philox4 x = philox4x32_10(static_cast<uint32_t>(g), static_cast<uint32_t>(gr),
                              static_cast<uint32_t>(gr >> 32), static_cast<uint32_t>(g >> 32),
                              static_cast<uint32_t>(s.key), static_cast<uint32_t>(s.key >> 32));
    transform4(s.dist, x, w->v);
  }
  w->seg = &s;
  w->row = row;
  w->c_first = static_cast<int64_t>((g >> 3) * 32 + (g & 7)) - s.col_offset;
}

}  // namespace metamat
