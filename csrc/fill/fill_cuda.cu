// CUDA backend of the init engine: one launch fills every segment of a call. The work
// decomposition (fill_units.h) and each warp's and thread's work (fill_unit_work.h) are shared
// with the host emulation that tests them; this file adds only the kernel and the launch (the
// device stores and warp: fill_sink_cuda.cuh).
// Built with --fmad=false so the float transforms round exactly as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "metamat/check.h"
#include "metamat/detail/cuda_check.h"
#include "metamat/fill.h"
#include "fill_kernel.cuh"
#include "fill_sink_cuda.cuh"
#include "fill_warp_work.h"
#include "fill_units.h"


namespace metamat {
namespace {

// Resident blocks per SM the register allocation must allow. With the staged write-out, 2 gives
// the compiler 128 registers (116 used, no spills); 3 caps them at 80 and spills 228 bytes.
// Measured on an H100 (10 GiB, fp32 Uniform): 0.98x fill_ at 2 against 0.81x at 3; Normal and
// bf16 equal within noise; 10,240 tables of 1 MiB 1.17x one table's time at 2, 1.08x at 3.
#ifndef METAMAT_FILL_MIN_BLOCKS
#define METAMAT_FILL_MIN_BLOCKS 2
#endif

// One thread block per tile; the block finds its segment, then each warp runs its units
// (fill_warp_work.h run_warp_any: interior units staged in `stage`, written out warp-wide).
__global__ void __launch_bounds__(kTileThreads, METAMAT_FILL_MIN_BLOCKS)
fill_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t tile_base) {
  __shared__ __align__(16) unsigned char stage[kStageBytes];
  __shared__ uintptr_t staged_at[kTileThreads];
  const int64_t tile = tile_base + blockIdx.x;
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {  // block-uniform: every thread narrows the same [lo, hi]
    const int64_t step = search_step(lo, hi);
    const int count =
        __syncthreads_count(search_probe(segs, lo, hi, step, threadIdx.x, tile));
    search_narrow(&lo, &hi, step, count);
  }
  const Segment& s = segs[lo];  // read where used (L1-cached), not held in registers
  const int lane = threadIdx.x % kWarpSize;
  DeviceSink direct;
  run_warp_any<CfgBase>(s, tile - s.launch.tile_begin, int(threadIdx.x) - lane, DeviceWarp{lane},
                        stage, staged_at, DeviceSlots{}, direct, DeviceStore{});
}

#if defined(METAMAT_FILL_VARIANTS)
// The one (dtype, kind) all segments share, else -1 (the specialized variants' choice).
void common_pair(const Segment* segs, int64_t n, int* dtype, int* kind) {
  *dtype = segs[0].dtype;
  *kind = segs[0].dist.kind;
  for (int64_t i = 1; i < n; ++i) {
    if (segs[i].dtype != *dtype || segs[i].dist.kind != *kind) {
      *dtype = *kind = -1;
      return;
    }
  }
}

// Any other variant, or more than one tile per block: the A/B kernels (fill_kernel.cuh), built
// only with METAMAT_FILL_VARIANTS=1.
void launch_variant(const FillOptions& o, const Segment* table, const Segment* dsegs,
                    const LaunchPlan& plan, cudaStream_t st) {
  VariantLaunch l{dsegs, plan.segments, plan.tiles, o.tiles_per_block, -1, -1, st};
  common_pair(table, plan.segments, &l.dtype, &l.kind);
  if (launch_variant_a(o.variant, l) || launch_variant_bits(o.variant, l) ||
      launch_variant_b(o.variant, l) || launch_variant_hsplit(o.variant, l) ||
      launch_variant_c(o.variant, l) || launch_variant_cs(o.variant, l) ||
      launch_variant_spec(o.variant, l) || launch_variant_spec2(o.variant, l) ||
      launch_variant_spec2b(o.variant, l))
    return;
  fail(__FILE__, __LINE__, "init kernel variant " + std::to_string(o.variant) + " has no launcher");
}
#endif

}  // namespace

bool cuda_compiled() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

void fill_cuda(const Segment* segs, int64_t n, Segment* staging, void* dev_scratch,
               void* stream, FillOptions opt) {
  MM_CHECK(n >= 0, "negative segment count");
  opt = resolve_fill_options(opt);
  const bool variant = opt.variant != kVarBase || opt.tiles_per_block != 1;
#if !defined(METAMAT_FILL_VARIANTS)
  MM_CHECK(!variant, "init kernel variant " + std::to_string(opt.variant) + " with " +
                         std::to_string(opt.tiles_per_block) +
                         " tile(s) per block is not in this build (only variant 0 with 1 tile "
                         "per block is): rebuild with METAMAT_FILL_VARIANTS=1, or unset "
                         "METAMAT_FILL_VARIANT and METAMAT_FILL_TILES");
#endif
  if (n == 0) return;
  MM_CHECK(staging != nullptr && dev_scratch != nullptr, "null staging or scratch buffer");
  const LaunchPlan plan = prepare_launch(segs, n, staging);
  if (plan.tiles == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  // From page-locked `staging` the copy is asynchronous (the caller keeps it alive until the
  // stream passes); from pageable memory CUDA stages it before returning.
  MM_CUDA_CHECK(cudaMemcpyAsync(dev_scratch, staging, plan.segments * sizeof(Segment),
                                cudaMemcpyHostToDevice, st));
  const auto* dsegs = static_cast<const Segment*>(dev_scratch);
#if defined(METAMAT_FILL_VARIANTS)
  if (variant) return launch_variant(opt, staging, dsegs, plan, st);
#endif
  // One launch unless the tile count exceeds the grid limit (2^31 - 1 blocks).
  const int64_t max_blocks = 2147483647;
  for (int64_t base = 0; base < plan.tiles; base += max_blocks) {
    const int64_t blocks = std::min(max_blocks, plan.tiles - base);
    fill_kernel<<<static_cast<unsigned>(blocks), kTileThreads, 0, st>>>(dsegs, plan.segments,
                                                                         base);
    MM_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace metamat
