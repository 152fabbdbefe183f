// CUDA backend of the init engine: one launch fills every segment of a call. The work
// decomposition (fill_units.h) and each thread's work (fill_unit_work.h) are shared with the
// host emulation that tests them; this file adds only the stores, the kernel and the launch.
// Built with --fmad=false so the float transforms round exactly as on the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "check.h"
#include "cuda_check.h"
#include "fill.h"
#include "fill_sink_cuda.cuh"
#include "fill_unit_work.h"
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

// Interior units are staged in shared memory and written out by their whole warp.
// A thread runs a whole unit (fill_units.h), so stored in place its 16-byte vectors would land
// 32 * kSize bytes apart across a warp: every store instruction touches 32 lines for 16 bytes
// each, and fp32 Uniform reached 0.22x of fill_ on an H100. Written out here, lane l of step i
// stores chunk 32 i + l of the warp's units: 512 contiguous bytes per instruction wherever the
// units are (a table's interior). fp64 units (256 B) keep the in-place stores.
constexpr int kStageUnitBytes = 32 * 4;         // the largest staged unit: 32 fp32 columns
constexpr int kStagePad = 16;                   // slot padding: 8 lanes' 16-B writes hit 8 banks

template <class T>
struct StagedSlot {
  static constexpr int kUnit = 32 * T::kSize;   // bytes of one unit: 128 fp32, 64 fp16/bf16
  static constexpr int kStride = kUnit + kStagePad;
  static constexpr int kChunks = kUnit / 16;    // 16-byte chunks per unit
};

// The Sink of interior units here: the unit's vectors go to its slot at their offset in the
// unit (`base` is the unit's address); the packing is DeviceSink's, so values are identical.
template <class T>
struct SlotSink {
  unsigned char* slot;
  uintptr_t base;
  template <class U, int N>
  __device__ __forceinline__ void vec(uintptr_t a, const float* f) const {
    static_assert(std::is_same_v<U, T>, "one dtype per slot");
    unsigned char* d = slot + (a - base);
    if constexpr (std::is_same_v<T, F32>) {
#pragma unroll
      for (int k = 0; k < N; k += 4)
        *reinterpret_cast<float4*>(d + 4 * k) = make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]);
    } else {
      static_assert(N == 8, "interior 16-bit words are 8 elements");
      *reinterpret_cast<uint4*>(d) = make_uint4(pack2(T{}, f[0], f[1]), pack2(T{}, f[2], f[3]),
                                                pack2(T{}, f[4], f[5]), pack2(T{}, f[6], f[7]));
    }
  }
  template <class U>
  __device__ __forceinline__ void one(uintptr_t, float) const { __trap(); }  // edge units only
  __device__ __forceinline__ void philox(int) const {}
};

// run_thread (fill_unit_work.h) with interior units staged: the same units, in the same order,
// by the same thread; only where the bytes are stored from differs. Every lane of a warp runs
// the loop the same number of times (the write-out is warp-wide): a warp's units are
// consecutive, so its lane 0 decides when it ends.
template <DistKind K, class T>
__device__ void run_thread_staged(const Segment& s, int64_t tile, int tid, unsigned char* stage,
                                  uintptr_t* staged_at) {
  using Slot = StagedSlot<T>;
  const int lane = tid & 31, warp0 = tid - lane;
  unsigned char* mine = stage + tid * Slot::kStride;
  const int64_t first = tile * kTile + tid;
  DeviceSink direct;
#pragma unroll 1
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const int64_t u = first + int64_t{k} * kTileThreads;
    if (u - lane >= s.launch.units) return;  // the warp's first unit: warp-uniform
    uintptr_t at = 0;
    if (u < s.launch.units) {
      const UnitPos p = unit_pos<T::kSize>(s, u);
      const uintptr_t a = p.row + static_cast<uintptr_t>(p.cb * T::kSize);
      if (p.cb >= 0 && p.cb + 32 <= s.cols && (a & 15) == 0) {
        SlotSink<T> slot{mine, a};
        interior_unit<K, T>(s, p, a, slot);
        at = a;
      } else {
        edge_unit<K, T>(s, p, a, direct);
      }
    }
    staged_at[tid] = at;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < Slot::kChunks; ++i) {
      const int c = i * 32 + lane, unit = warp0 + c / Slot::kChunks;
      const int off = (c % Slot::kChunks) * 16;
      const uintptr_t dst = staged_at[unit];
      if (dst != 0)
        __stwb(reinterpret_cast<uint4*>(dst + off),
               *reinterpret_cast<const uint4*>(stage + unit * Slot::kStride + off));
    }
    __syncwarp();  // the slots and addresses are rewritten by the next unit
  }
}

template <class T>
__device__ void run_thread_staged_dist(const Segment& s, int64_t tile, int tid,
                                       unsigned char* stage, uintptr_t* staged_at) {
  switch (static_cast<DistKind>(s.dist.kind)) {
    case DistKind::kUniform:
      return run_thread_staged<DistKind::kUniform, T>(s, tile, tid, stage, staged_at);
    case DistKind::kNormal:
      return run_thread_staged<DistKind::kNormal, T>(s, tile, tid, stage, staged_at);
    case DistKind::kTruncNormal:
      return run_thread_staged<DistKind::kTruncNormal, T>(s, tile, tid, stage, staged_at);
    case DistKind::kConstant:
      return run_thread_staged<DistKind::kConstant, T>(s, tile, tid, stage, staged_at);
  }
}

// One thread block per tile; the block finds its segment, then each thread runs its units.
__global__ void __launch_bounds__(kTileThreads, METAMAT_FILL_MIN_BLOCKS)
fill_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t tile_base) {
  __shared__ __align__(16) unsigned char stage[kTileThreads * (kStageUnitBytes + kStagePad)];
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
  const int64_t t = tile - s.launch.tile_begin;
  switch (static_cast<DType>(s.dtype)) {
    case DType::kFloat32:
      return run_thread_staged_dist<F32>(s, t, threadIdx.x, stage, staged_at);
    case DType::kFloat16:
      return run_thread_staged_dist<F16>(s, t, threadIdx.x, stage, staged_at);
    case DType::kBFloat16:
      return run_thread_staged_dist<BF16>(s, t, threadIdx.x, stage, staged_at);
    default: {  // fp64: in-place stores
      DeviceSink out;
      run_thread_any(s, t, threadIdx.x, out);
    }
  }
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
