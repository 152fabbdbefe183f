// The init kernel as a template over its variant (fill_variant.h), for the A/B builds
// (fill_cuda_var_*.cu, METAMAT_FILL_VARIANTS=1). The production kernel (fill_cuda.cu) is the
// measured one; this template adds what the variants change: the KernelCfg of the shared code,
// a kernel specialized to one (dtype, distribution), its register bound, and a block that runs
// `per` consecutive tiles (one segment search, then advance_segment) instead of one.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "metamat/detail/cuda_check.h"
#include "metamat/fill.h"
#include "fill_sink_cuda.cuh"
#include "fill_warp_work.h"
#include "fill_units.h"

namespace metamat {

// Any (dtype, distribution): the generic dispatch of run_warp_any.
struct AnyPair {
  static constexpr int dtype = -1, kind = -1;
};
// Only segments of one dtype and distribution (the launcher checks before choosing it).
template <class T, DistKind K>
struct OnePair {
  using Type = T;
  static constexpr DistKind Kind = K;
  static constexpr int kind = static_cast<int>(K);
};

template <class Cfg, class Pair, int kMinBlocks>
__global__ void __launch_bounds__(kTileThreads, kMinBlocks)
fill_kernel_v(const Segment* __restrict__ segs, int64_t nseg, int64_t block_base, int64_t tiles,
              int per) {
  __shared__ __align__(16) unsigned char stage[kStageBytes];
  __shared__ uintptr_t staged_at[kTileThreads];
  const int64_t first = (block_base + blockIdx.x) * per;
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {  // block-uniform: every thread narrows the same [lo, hi]
    const int64_t step = search_step(lo, hi);
    const int count =
        __syncthreads_count(search_probe(segs, lo, hi, step, threadIdx.x, first));
    search_narrow(&lo, &hi, step, count);
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp0 = int(threadIdx.x) - lane;
  DeviceSinkT<Cfg::store> direct;
  const int64_t end = first + per < tiles ? first + per : tiles;
#pragma unroll 1
  for (int64_t tile = first; tile < end; ++tile) {
    lo = tile == first ? lo : advance_segment(segs, nseg, lo, tile);
    const Segment& s = segs[lo];
    if constexpr (Pair::kind < 0) {
      run_warp_any<Cfg>(s, tile - s.launch.tile_begin, warp0, DeviceWarp{lane}, stage, staged_at,
                        DeviceSlots{}, direct, DeviceStoreT<Cfg::store>{});
    } else {
      run_warp_fixed<Cfg, typename Pair::Type, Pair::Kind>(
          s, tile - s.launch.tile_begin, warp0, DeviceWarp{lane}, stage, staged_at, DeviceSlots{},
          direct, DeviceStoreT<Cfg::store>{});
    }
  }
}

// Launches fill_kernel_v over `tiles` tiles, `per` per block, in grids of at most 2^31 - 1.
template <class Cfg, class Pair, int kMinBlocks>
void launch_fill_v(const Segment* dsegs, int64_t nseg, int64_t tiles, int per, cudaStream_t st) {
  const int64_t blocks_total = (tiles + per - 1) / per;
  const int64_t max_blocks = 2147483647;
  for (int64_t base = 0; base < blocks_total; base += max_blocks) {
    const int64_t blocks = std::min(max_blocks, blocks_total - base);
    fill_kernel_v<Cfg, Pair, kMinBlocks>
        <<<static_cast<unsigned>(blocks), kTileThreads, 0, st>>>(dsegs, nseg, base, tiles, per);
    MM_CUDA_CHECK(cudaGetLastError());
  }
}

// What a variant launcher gets: the uploaded table and its plan, and the one (dtype, kind) of
// every segment when they share one (else -1).
struct VariantLaunch {
  const Segment* dsegs;
  int64_t nseg, tiles;
  int per;
  int dtype, kind;
  cudaStream_t stream;
};

// The specialized kernels of the `spec` variants: one per (fp32 | fp16 | bf16) x (Uniform |
// Normal | TruncatedNormal); false when the launch's segments do not share one such pair.
// Blocks per SM each specialized kernel is bounded for (256 threads each).
#ifndef METAMAT_FILL_SPEC_MIN_BLOCKS
#define METAMAT_FILL_SPEC_MIN_BLOCKS 3
#endif
constexpr int kSpecMinBlocks = METAMAT_FILL_SPEC_MIN_BLOCKS;

template <class Cfg, int kMinBlocks = kSpecMinBlocks>
bool launch_pair(const VariantLaunch& l) {
  auto go = [&](auto pair) {
    launch_fill_v<Cfg, decltype(pair), kMinBlocks>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
    return true;
  };
  const auto U = DistKind::kUniform, N = DistKind::kNormal, TN = DistKind::kTruncNormal;
  switch (static_cast<DType>(l.dtype)) {
    case DType::kFloat32:
      if (l.kind == int(U)) return go(OnePair<F32, U>{});
      if (l.kind == int(N)) return go(OnePair<F32, N>{});
      if (l.kind == int(TN)) return go(OnePair<F32, TN>{});
      return false;
    case DType::kFloat16:
      if (l.kind == int(U)) return go(OnePair<F16, U>{});
      if (l.kind == int(N)) return go(OnePair<F16, N>{});
      if (l.kind == int(TN)) return go(OnePair<F16, TN>{});
      return false;
    case DType::kBFloat16:
      if (l.kind == int(U)) return go(OnePair<BF16, U>{});
      if (l.kind == int(N)) return go(OnePair<BF16, N>{});
      if (l.kind == int(TN)) return go(OnePair<BF16, TN>{});
      return false;
    default:
      return false;
  }
}

// The variant files' launchers (fill_cuda_var_*.cu, one or two kernels each so they compile
// in parallel): true when `variant` is theirs.
bool launch_variant_a(int variant, const VariantLaunch& l);       // base (tiles > 1), math
bool launch_variant_bits(int variant, const VariantLaunch& l);    // philoxbits
bool launch_variant_b(int variant, const VariantLaunch& l);       // split
bool launch_variant_hsplit(int variant, const VariantLaunch& l);  // halfsplit
bool launch_variant_c(int variant, const VariantLaunch& l);       // plainstore
bool launch_variant_cs(int variant, const VariantLaunch& l);      // streamstore
bool launch_variant_spec(int variant, const VariantLaunch& l);    // spec
bool launch_variant_spec2(int variant, const VariantLaunch& l);   // specsplit
bool launch_variant_spec2b(int variant, const VariantLaunch& l);  // spec2b

}  // namespace metamat
