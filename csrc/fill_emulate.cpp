// Host emulation of the CUDA launch (fill_cuda.cu): the same tiles, the same per-block
// segment search and the same per-unit work (fill_units.h), run by a loop instead of a
// grid. Lets machines without a GPU test the kernel's indexing against the CPU engine.
#include <cstring>
#include <vector>

#include "check.h"
#include "fill.h"
#include "fill_units.h"
#include "float_convert.h"

namespace metamat {
namespace {

void store_unit_host(const UnitWork& w) {
  const Segment& s = *w.seg;
  for (int i = 0; i < 4; ++i) {
    const int64_t c = w.c_first + 8 * i;
    if (c < 0 || c >= s.cols) continue;
    const int64_t at = w.row * s.row_stride + c;
    switch (static_cast<DType>(s.dtype)) {
      case DType::kFloat32: reinterpret_cast<float*>(s.ptr)[at] = w.v[i]; break;
      case DType::kFloat16: reinterpret_cast<uint16_t*>(s.ptr)[at] = to_half_bits(w.v[i]); break;
      case DType::kBFloat16: reinterpret_cast<uint16_t*>(s.ptr)[at] = to_bf16_bits(w.v[i]); break;
      case DType::kFloat64: reinterpret_cast<double*>(s.ptr)[at] = w.v[i]; break;
    }
  }
}

}  // namespace

void fill_cuda_emulated(const Segment* segs, int64_t n) {
  std::vector<Segment> host(segs, segs + n);
  const int64_t units = assign_units(host);
  const int64_t nseg = static_cast<int64_t>(host.size());
  for (int64_t u0 = 0; u0 < units; u0 += kTile) {  // one iteration = one thread block
    const int64_t last = std::min(u0 + kTile, units) - 1;
    const int64_t lo = find_segment(host.data(), 0, nseg - 1, u0);
    const int64_t hi = find_segment(host.data(), lo, nseg - 1, last);
    for (int k = 0; k < kUnitsPerThread; ++k)
      for (int t = 0; t < kTileThreads; ++t) {
        const int64_t u = u0 + k * kTileThreads + t;
        if (u >= units) break;
        UnitWork w;
        compute_unit(host.data(), lo, hi, u, &w);
        store_unit_host(w);
      }
  }
}

}  // namespace metamat
