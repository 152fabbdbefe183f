// The fused init engine: fill many blocks of many tables in one call.
// Torch-free: the caller owns every byte; the core only writes through the pointers given.
#pragma once
#include <cstdint>
#include <string>

#include "philox.h"

namespace metamat {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// One block to fill: rows x cols elements at ptr (row stride in elements, unit col stride),
// holding global rows [row_offset, row_offset+rows) and cols [col_offset, col_offset+cols)
// of the table whose Philox key is `key`. Layout is fixed (128 bytes): Python packs it with a
// matching NumPy structured dtype (metamat/fill_init.py, SEGMENT_DTYPE).
struct Segment {
  uint64_t ptr;
  int64_t rows, cols, row_stride, row_offset, col_offset;
  uint64_t key;
  int32_t dtype;
  DistParams dist;       // 28 bytes
  int64_t unit_begin;    // CUDA only: first work unit of this segment (set by the core)
  int64_t reserved[4];
};
static_assert(sizeof(DistParams) == 28, "DistParams layout");
static_assert(sizeof(Segment) == 128, "Segment layout is shared with Python");

// Fill on the CPU with `num_threads` threads (the caller's thread is one of them), with the
// widest kernel this CPU runs, or the one named by `isa` ("avx512", "avx2", "x86-64"; tests).
void fill_cpu(const Segment* segs, int64_t n, int num_threads, const std::string& isa = "");
// Which CPU kernel fill_cpu runs on this machine: "avx512", "avx2" or "x86-64".
const char* cpu_kernel_name();

// True when this build carries the CUDA backend.
bool cuda_compiled();
// Number of usable CUDA devices (0 when none or no driver); never throws.
int cuda_device_count();
// Fill CUDA memory: one kernel launch on `stream` for all segments (chunked only when the
// work exceeds the grid limits). `dev_scratch` is caller-owned device memory of
// n * sizeof(Segment) bytes that must stay alive until the stream passes this launch.
void fill_cuda(const Segment* segs, int64_t n, void* dev_scratch, void* stream);
// The CUDA launch's decomposition run on the host (tests the kernel's indexing without a GPU).
void fill_cuda_emulated(const Segment* segs, int64_t n);

}  // namespace metamat
