// The fused init engine: fill many blocks of many tables in one call.
// Torch-free: the caller owns every byte; the core only writes through the pointers given.
#pragma once
#include <cstdint>
#include <string>

#include "metamat/dtype.h"
#include "metamat/fill_variant.h"
#include "metamat/philox.h"

namespace metamat {

// Where a segment sits in the CUDA launch (fill_units.h `prepare_launch` writes it; Python
// leaves it zero). 40 bytes.
struct LaunchInfo {
  int64_t tile_begin;              // first tile (thread block) of the segment
  int64_t units;                   // work units: rows x 32-column blocks per row
  int64_t blocks_per_row;          // 32-column blocks one row touches
  uint32_t div_magic, div_shift;   // unit / blocks_per_row in 32 bits (when not kWideIndex)
  uint32_t flags;                  // LaunchFlags (fill_units.h)
  uint32_t scale;                  // float bits: the Uniform/TruncatedNormal scale times 2^-24
                                   // (with kFoldedScale; kernel variants, fill_variant.h)
};

// One block to fill: rows x cols elements at ptr (row stride in elements, unit col stride),
// holding global rows [row_offset, row_offset+rows) and cols [col_offset, col_offset+cols)
// of the table whose Philox key is `key`. Layout is fixed (128 bytes): Python packs it with a
// matching NumPy structured dtype (metamat/init.py, SEGMENT_DTYPE).
struct Segment {
  uint64_t ptr;
  int64_t rows, cols, row_stride, row_offset, col_offset;
  uint64_t key;
  int32_t dtype;         // DType (dtype.h)
  DistParams dist;       // 28 bytes
  LaunchInfo launch;     // CUDA only: set by the core
};
static_assert(sizeof(DistParams) == 28, "DistParams layout");
static_assert(sizeof(LaunchInfo) == 40, "LaunchInfo layout");
static_assert(sizeof(Segment) == 128, "Segment layout is shared with Python");

// Fill on the CPU with `num_threads` threads (the caller's thread is one of them), with the
// widest kernel this CPU runs, or the one named by `isa` ("avx512", "avx2", "x86-64"; tests).
void fill_cpu(const Segment* segs, int64_t n, int num_threads, const std::string& isa = "");
// Which CPU kernel fill_cpu runs on this machine: "avx512", "avx2" or "x86-64".
const char* cpu_kernel_name();
// Why that kernel: "CPUID: ...", "METAMAT_CPU_KERNEL", or "measured: ..." with the timings.
std::string cpu_kernel_choice();

// True when this build carries the CUDA backend.
bool cuda_compiled();
// Number of usable CUDA devices (0 when none or no driver); never throws.
int cuda_device_count();
// Fill CUDA memory: one kernel launch on `stream` for all segments (chunked only when the
// work exceeds the grid limits). The core allocates nothing: `staging` is caller-owned host
// memory of n * sizeof(Segment) bytes (page-locked, so the upload is asynchronous; pageable
// works too, and the copy is then staged before this returns) and `dev_scratch` caller-owned
// device memory of the same size. The core writes the launch's segment table to `staging`
// (`staging` may be `segs` itself) and copies it to `dev_scratch` with cudaMemcpyAsync on
// `stream`: both buffers must stay alive and unchanged until the stream passes this launch.
// `opt` picks a kernel variant and the tiles per thread block (fill_variant.h; default: the
// environment's METAMAT_FILL_VARIANT / METAMAT_FILL_TILES, else the measured kernel).
void fill_cuda(const Segment* segs, int64_t n, Segment* staging, void* dev_scratch,
               void* stream, FillOptions opt = FillOptions{});

// What the host emulation of the launch did (tests check the kernel's store decisions).
struct EmulationStats {
  int64_t tiles = 0, segments = 0, philox_calls = 0;
  int64_t vector_stores = 0, vector_bytes = 0, scalar_stores = 0;
};
// The CUDA launch run on the host: the same segment table, block search, per-thread units and
// vector/scalar store decisions as the kernel, writing CPU memory. `force_wide` makes every
// segment take the 64-bit index path (normally only segments of >= 2^31 units do).
// `opt` as fill_cuda's: the emulation runs the variant's shared code and tile walk.
EmulationStats fill_cuda_emulated(const Segment* segs, int64_t n, bool force_wide = false,
                                  FillOptions opt = FillOptions{});

}  // namespace metamat
