// CUDA backend of the init engine: one launch fills every segment of a call. The work
// decomposition lives in fill_units.h (shared with the host emulation that tests it).
// Built with --fmad=false so the float transforms round exactly as on the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "check.h"
#include "fill.h"
#include "fill_units.h"

#define MM_CUDA_CHECK(expr)                                                                \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess)                                                               \
      ::metamat::fail(__FILE__, __LINE__,                                                  \
                      std::string(#expr) + " failed: " + cudaGetErrorString(err_));        \
  } while (0)

namespace metamat {
namespace {

template <typename T>
__device__ __forceinline__ T convert(float v);
template <> __device__ __forceinline__ float convert<float>(float v) { return v; }
template <> __device__ __forceinline__ double convert<double>(float v) { return v; }
template <> __device__ __forceinline__ __half convert<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 convert<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Word i of the unit goes to local column c_first + 8*i (8 neighbouring threads write 8
// consecutive elements per word: coalesced).
template <typename T>
__device__ __forceinline__ void store_unit(const UnitWork& w) {
  T* out = reinterpret_cast<T*>(w.seg->ptr) + w.row * w.seg->row_stride;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = w.c_first + 8 * i;
    if (c >= 0 && c < w.seg->cols) out[c] = convert<T>(w.v[i]);
  }
}

__global__ void __launch_bounds__(kTileThreads)
fill_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t unit_base,
            int64_t unit_end) {
  __shared__ int64_t seg_range[2];
  const int64_t u0 = unit_base + static_cast<int64_t>(blockIdx.x) * kTile;
  if (threadIdx.x == 0) {
    const int64_t last = min(u0 + kTile, unit_end) - 1;
    const int64_t lo = find_segment(segs, 0, nseg - 1, u0);
    seg_range[0] = lo;
    seg_range[1] = find_segment(segs, lo, nseg - 1, last);
  }
  __syncthreads();
  const int64_t lo = seg_range[0], hi = seg_range[1];
#pragma unroll
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const int64_t u = u0 + k * kTileThreads + threadIdx.x;
    if (u >= unit_end) break;
    UnitWork w;
    compute_unit(segs, lo, hi, u, &w);
    switch (static_cast<DType>(w.seg->dtype)) {
      case DType::kFloat32: store_unit<float>(w); break;
      case DType::kFloat16: store_unit<__half>(w); break;
      case DType::kBFloat16: store_unit<__nv_bfloat16>(w); break;
      case DType::kFloat64: store_unit<double>(w); break;
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

void fill_cuda(const Segment* segs, int64_t n, void* dev_scratch, void* stream) {
  std::vector<Segment> host(segs, segs + n);
  for (const auto& s : host)
    MM_CHECK(s.rows >= 0 && s.cols >= 0 && s.row_offset >= 0 && s.col_offset >= 0,
             "negative size or offset");
  const int64_t units = assign_units(host);  // drops empty segments
  if (units == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `host` may go.
  MM_CUDA_CHECK(cudaMemcpyAsync(dev_scratch, host.data(), host.size() * sizeof(Segment),
                                cudaMemcpyHostToDevice, st));
  const auto* dsegs = static_cast<const Segment*>(dev_scratch);
  const int64_t nseg = static_cast<int64_t>(host.size());
  // One launch unless the tile count exceeds the grid limit (2^31 - 1 blocks).
  const int64_t max_blocks = 2147483647;
  for (int64_t base = 0; base < units; base += max_blocks * kTile) {
    const int64_t end = std::min(units, base + max_blocks * kTile);
    const int64_t blocks = (end - base + kTile - 1) / kTile;
    fill_kernel<<<static_cast<unsigned>(blocks), kTileThreads, 0, st>>>(dsegs, nseg, base, end);
    MM_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace metamat
