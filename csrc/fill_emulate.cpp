// Host emulation of the CUDA launch (fill_cuda.cu): the same segment table (prepare_launch),
// the same per-block segment search, the same per-thread units and store decisions
// (fill_unit_work.h), run by loops instead of a grid. Lets machines without a GPU test the
// kernel's indexing against the CPU engine; the stores check the alignment the GPU requires
// and are counted, so tests also see which path (vector or scalar) the kernel takes.
#include <cstring>
#include <type_traits>
#include <vector>

#include "check.h"
#include "dtype.h"
#include "fill.h"
#include "fill_unit_work.h"
#include "fill_units.h"

namespace metamat {
namespace {

template <class T>
void put(uintptr_t a, float v) {
  if constexpr (std::is_same_v<T, F32>) {
    std::memcpy(reinterpret_cast<void*>(a), &v, 4);
  } else if constexpr (std::is_same_v<T, F64>) {
    const double x = v;
    std::memcpy(reinterpret_cast<void*>(a), &x, 8);
  } else {
    const uint16_t h = std::is_same_v<T, F16> ? f32_to_f16(v) : f32_to_bf16(v);
    std::memcpy(reinterpret_cast<void*>(a), &h, 2);
  }
}

// The emulation's stores: what the kernel's would write, with the GPU's alignment rules.
struct HostSink {
  EmulationStats* st;

  template <class T, int N>
  void vec(uintptr_t a, const float* f) const {
    constexpr uintptr_t bytes = N * T::kSize, align = bytes < 16 ? bytes : 16;
    MM_CHECK(a % align == 0, "emulated launch: misaligned " + std::to_string(bytes) +
                                 "-byte vector store (the kernel would fault)");
    for (int k = 0; k < N; ++k) put<T>(a + k * T::kSize, f[k]);
    st->vector_stores += bytes / align;
    st->vector_bytes += bytes;
  }
  template <class T>
  void one(uintptr_t a, float v) const {
    put<T>(a, v);
    ++st->scalar_stores;
  }
  void philox(int n) const { st->philox_calls += n; }
};

}  // namespace

EmulationStats fill_cuda_emulated(const Segment* segs, int64_t n, bool force_wide) {
  EmulationStats st;
  std::vector<Segment> table(segs, segs + n);  // the kernel's copy in device memory
  const LaunchPlan plan = prepare_launch(table.data(), n, table.data(), force_wide);
  st.tiles = plan.tiles;
  st.segments = plan.segments;
  HostSink out{&st};
  for (int64_t tile = 0; tile < plan.tiles; ++tile) {  // one iteration = one thread block
    int64_t lo = 0, hi = plan.segments - 1;
    while (lo < hi) {
      const int64_t step = search_step(lo, hi);
      int count = 0;  // __syncthreads_count
      for (int t = 0; t < kTileThreads; ++t)
        count += search_probe(table.data(), lo, hi, step, t, tile) ? 1 : 0;
      search_narrow(&lo, &hi, step, count);
    }
    const Segment& s = table[lo];
    for (int t = 0; t < kTileThreads; ++t)
      run_thread_any(s, tile - s.launch.tile_begin, t, out);
  }
  return st;
}

}  // namespace metamat
