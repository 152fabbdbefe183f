// CUDA backend of the init engine: one launch fills every segment of a call.
// Work unit = one Philox counter of one row: columns 32*(g/8) + 8*i + g%8, i = 0..3 (see
// philox.h); 8 neighbouring threads write 8 consecutive floats per word. Units of all
// segments are numbered consecutively; each block takes a tile of units and finds the
// segments it touches by binary search over their first units.
// Built with --fmad=false so the float transforms round exactly as on the CPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "check.h"
#include "fill.h"

#define MM_CUDA_CHECK(expr)                                                                \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess)                                                               \
      ::metamat::fail(__FILE__, __LINE__,                                                  \
                      std::string(#expr) + " failed: " + cudaGetErrorString(err_));        \
  } while (0)

namespace metamat {
namespace {

constexpr int kThreads = 256;
constexpr int kUnitsPerThread = 4;
constexpr int64_t kTile = int64_t{kThreads} * kUnitsPerThread;

// Philox counters per row: 8 per 32-column block the segment's columns touch.
__host__ __device__ __forceinline__ int64_t counters_per_row(const Segment& s) {
  return 8 * (((s.col_offset + s.cols - 1) >> 5) - (s.col_offset >> 5) + 1);
}

// Index of the last segment whose unit_begin <= u, searching [lo, hi].
__device__ __forceinline__ int64_t find_segment(const Segment* segs, int64_t lo, int64_t hi,
                                                int64_t u) {
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) >> 1;
    if (segs[mid].unit_begin <= u) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
__device__ __forceinline__ T convert(float v);
template <> __device__ __forceinline__ float convert<float>(float v) { return v; }
template <> __device__ __forceinline__ double convert<double>(float v) { return v; }
template <> __device__ __forceinline__ __half convert<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 convert<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Word i of counter g goes to local column c_first + 8*i.
template <typename T>
__device__ __forceinline__ void store_counter(const Segment& s, int64_t row, int64_t c_first,
                                              const float v[4]) {
  T* out = reinterpret_cast<T*>(s.ptr) + row * s.row_stride;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t c = c_first + 8 * i;
    if (c >= 0 && c < s.cols) out[c] = convert<T>(v[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
fill_kernel(const Segment* __restrict__ segs, int64_t nseg, int64_t unit_base,
            int64_t unit_end) {
  __shared__ int64_t seg_range[2];
  const int64_t u0 = unit_base + static_cast<int64_t>(blockIdx.x) * kTile;
  if (threadIdx.x == 0) {
    int64_t last = min(u0 + kTile, unit_end) - 1;
    int64_t lo = find_segment(segs, 0, nseg - 1, u0);
    seg_range[0] = lo;
    seg_range[1] = find_segment(segs, lo, nseg - 1, last);
  }
  __syncthreads();
  const int64_t lo = seg_range[0], hi = seg_range[1];
#pragma unroll
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const int64_t u = u0 + k * kThreads + threadIdx.x;
    if (u >= unit_end) break;
    const int64_t si = lo == hi ? lo : find_segment(segs, lo, hi, u);
    const Segment& s = segs[si];
    const int64_t ngr = counters_per_row(s);
    const int64_t local = u - s.unit_begin;
    // 32-bit division when it fits (the common case): 64-bit division is emulated.
    const int64_t row = (local >> 32) == 0 && (ngr >> 32) == 0
                            ? static_cast<uint32_t>(local) / static_cast<uint32_t>(ngr)
                            : local / ngr;
    const int64_t gi = local - row * ngr;
    const uint64_t g = static_cast<uint64_t>((s.col_offset >> 5) * 8 + gi);
    const uint64_t gr = static_cast<uint64_t>(s.row_offset + row);
    float v[4];
    if (s.dist.kind == static_cast<int32_t>(DistKind::kConstant)) {
      v[0] = v[1] = v[2] = v[3] = s.dist.p0;
    } else {
      Philox4 w = philox4x32_10(static_cast<uint32_t>(g), static_cast<uint32_t>(gr),
                                static_cast<uint32_t>(gr >> 32), static_cast<uint32_t>(g >> 32),
                                static_cast<uint32_t>(s.key), static_cast<uint32_t>(s.key >> 32));
      transform4(s.dist, w, v);
    }
    const int64_t c_first = static_cast<int64_t>((g >> 3) * 32 + (g & 7)) - s.col_offset;
    switch (static_cast<DType>(s.dtype)) {
      case DType::kFloat32: store_counter<float>(s, row, c_first, v); break;
      case DType::kFloat16: store_counter<__half>(s, row, c_first, v); break;
      case DType::kBFloat16: store_counter<__nv_bfloat16>(s, row, c_first, v); break;
      case DType::kFloat64: store_counter<double>(s, row, c_first, v); break;
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
  if (n == 0) return;
  std::vector<Segment> host(segs, segs + n);
  int64_t units = 0;
  for (auto& s : host) {
    MM_CHECK(s.rows >= 0 && s.cols >= 0 && s.row_offset >= 0 && s.col_offset >= 0,
             "negative size or offset");
    s.unit_begin = units;
    if (s.rows > 0 && s.cols > 0) units += s.rows * counters_per_row(s);
  }
  if (units == 0) return;
  auto st = static_cast<cudaStream_t>(stream);
  // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `host` may go.
  MM_CUDA_CHECK(cudaMemcpyAsync(dev_scratch, host.data(), n * sizeof(Segment),
                                cudaMemcpyHostToDevice, st));
  const auto* dsegs = static_cast<const Segment*>(dev_scratch);
  // One launch unless the tile count exceeds the grid limit (2^31 - 1 blocks).
  const int64_t max_blocks = 2147483647;
  for (int64_t base = 0; base < units; base += max_blocks * kTile) {
    const int64_t end = std::min(units, base + max_blocks * kTile);
    const int64_t blocks = (end - base + kTile - 1) / kTile;
    fill_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(dsegs, n, base, end);
    MM_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace metamat
