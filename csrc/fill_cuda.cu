// CUDA backend of the init engine: one launch fills every segment of a call. The work
// decomposition (fill_units.h) and each thread's work (fill_unit_work.h) are shared with the
// host emulation that tests them; this file adds only the stores, the kernel and the launch.
// Built with --fmad=false so the float transforms round exactly as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "check.h"
#include "cuda_check.h"
#include "fill.h"
#include "fill_sink_cuda.cuh"
#include "fill_unit_work.h"
#include "fill_units.h"


namespace metamat {
namespace {

// Resident blocks per SM the register allocation must allow: 3 caps registers at 80 with
// (almost) no spills; 2 gives the compiler 128, 4 spills the normal/trunc-normal paths.
#ifndef METAMAT_FILL_MIN_BLOCKS
#define METAMAT_FILL_MIN_BLOCKS 3
#endif

// One thread block per tile; the block finds its segment, then each thread runs its units.
__global__ void __launch_bounds__(kTileThreads, METAMAT_FILL_MIN_BLOCKS)
fill_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t tile_base) {
  const int64_t tile = tile_base + blockIdx.x;
  int64_t lo = 0, hi = nseg - 1;
  while (lo < hi) {  // block-uniform: every thread narrows the same [lo, hi]
    const int64_t step = search_step(lo, hi);
    const int count =
        __syncthreads_count(search_probe(segs, lo, hi, step, threadIdx.x, tile));
    search_narrow(&lo, &hi, step, count);
  }
  const Segment& s = segs[lo];  // read where used (L1-cached), not held in registers
  DeviceSink out;
  run_thread_any(s, tile - s.launch.tile_begin, threadIdx.x, out);
}

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
               void* stream) {
  MM_CHECK(n >= 0, "negative segment count");
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
