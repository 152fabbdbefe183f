// Host emulation of the CUDA launch (fill_cuda.cu): the same segment table (prepare_launch),
// the same per-block segment search, the same per-warp and per-thread units, staging and store
// decisions (fill_warp_work.h run_warp_any), run by loops instead of a grid: a warp's lanes
// run one after the other between its syncs, over a block's staging area as in shared memory.
// Lets machines without a GPU test the kernel's indexing against the CPU engine; the stores
// check the alignment the GPU requires and are counted, so tests also see which path (vector
// or scalar) the kernel takes.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "metamat/check.h"
#include "metamat/dtype.h"
#include "metamat/fill.h"
#include "fill_warp_work.h"
#include "fill_units.h"
#include "metamat/fill_variant.h"

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

// An interior unit's vectors into its slot of the staging area (the kernel's SlotSink).
template <class T>
struct HostSlotSink {
  unsigned char* slot;
  uintptr_t base;
  EmulationStats* st;
  template <class U, int N>
  void vec(uintptr_t a, const float* f) const {
    static_assert(std::is_same_v<U, T>, "one dtype per slot");
    const uintptr_t d = reinterpret_cast<uintptr_t>(slot) + (a - base);
    MM_CHECK(d % 16 == 0 && a - base + N * T::kSize <= uintptr_t(StagedSlot<T>::kUnit),
             "emulated launch: a staged vector outside its 16-byte aligned slot");
    for (int k = 0; k < N; ++k) put<T>(d + k * T::kSize, f[k]);
  }
  template <class U>
  void one(uintptr_t, float) const {
    fail(__FILE__, __LINE__, "emulated launch: a scalar store from an interior unit");
  }
  void philox(int n) const { st->philox_calls += n; }
};

struct HostSlots {
  EmulationStats* st;
  template <class T>
  HostSlotSink<T> make(unsigned char* slot, uintptr_t base) const { return {slot, base, st}; }
};

// The warp's write-out: one 16-byte vector store per chunk.
struct HostStore {
  EmulationStats* st;
  void chunk16(uintptr_t dst, const unsigned char* src) const {
    MM_CHECK(dst % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0,
             "emulated launch: misaligned 16-byte write-out (the kernel would fault)");
    std::memcpy(reinterpret_cast<void*>(dst), src, 16);
    st->vector_stores += 1;
    st->vector_bytes += 16;
  }
};

// The lanes of a warp, one after the other: everything a lane does between two syncs runs
// before the next lane starts, which is all the kernel's __syncwarp guarantees.
struct HostWarp {
  template <class F>
  void lanes(F&& f) const {
    for (int lane = 0; lane < kWarpSize; ++lane) f(lane);
  }
  void sync() const {}
};

// A block's staging area, 16-byte aligned as the kernel's __shared__ array.
struct Stage {
  unsigned char* p = static_cast<unsigned char*>(std::aligned_alloc(16, kStageBytes));
  ~Stage() { std::free(p); }
};

}  // namespace

EmulationStats fill_cuda_emulated(const Segment* segs, int64_t n, bool force_wide,
                                  FillOptions opt) {
  opt = resolve_fill_options(opt);
  EmulationStats st;
  std::vector<Segment> table(segs, segs + n);  // the kernel's copy in device memory
  const LaunchPlan plan = prepare_launch(table.data(), n, table.data(), force_wide);
  st.tiles = plan.tiles;
  st.segments = plan.segments;
  HostSink out{&st};
  Stage stage;
  MM_CHECK(stage.p != nullptr, "emulated launch: cannot allocate the staging area");
  std::vector<uintptr_t> staged_at(kTileThreads);
  const int64_t per = opt.tiles_per_block;
  with_kernel_cfg(opt.variant, [&](auto cfg) {
    using Cfg = decltype(cfg);
    // One iteration = one thread block: it searches its first tile's segment, then walks its
    // tiles (fill_kernel.cuh; the measured kernel is the case of one tile per block).
    for (int64_t first = 0; first < plan.tiles; first += per) {
      int64_t lo = 0, hi = plan.segments - 1;
      while (lo < hi) {
        const int64_t step = search_step(lo, hi);
        int count = 0;  // __syncthreads_count
        for (int t = 0; t < kTileThreads; ++t)
          count += search_probe(table.data(), lo, hi, step, t, first) ? 1 : 0;
        search_narrow(&lo, &hi, step, count);
      }
      const int64_t end = std::min(first + per, plan.tiles);
      for (int64_t tile = first; tile < end; ++tile) {
        lo = tile == first ? lo : advance_segment(table.data(), plan.segments, lo, tile);
        const Segment& s = table[lo];
        // stale bytes from earlier tiles, as shared memory would hold: the kernel must not
        // store them
        std::memset(stage.p, 0xA5, kStageBytes);
        for (int warp0 = 0; warp0 < kTileThreads; warp0 += kWarpSize)
          run_warp_any<Cfg>(s, tile - s.launch.tile_begin, warp0, HostWarp{}, stage.p,
                            staged_at.data(), HostSlots{&st}, out, HostStore{&st});
      }
    }
  });
  return st;
}

}  // namespace metamat
