// Staging buffers kept between pipelines. Page-locking host memory is slow (cudaHostAlloc ran
// at ~2.4 GiB/s on the H100 machine: a 192 MiB ring cost 80-100 ms of a 2 GiB load, and
// cudaFreeHost more), so a closed pipeline's ring is kept for the next one instead of freed.
//
// The cache holds at most one ring: the buffers of the pipeline closed last (giving back a
// buffer of another ring frees the ones held before). A pipeline takes a cached buffer of its
// kind (pinned on the same device, or plain) whose size is between what it needs and twice
// that; otherwise it allocates. stage_free_cached() frees everything cached (metamat's
// `release_staging_memory()`); METAMAT_STAGING_CACHE=0 turns the cache off (every buffer is
// freed when its pipeline closes). The pool is never destroyed: freeing page-locked memory
// from a static destructor could run after the CUDA runtime is gone, and the process's exit
// returns it anyway.
#pragma once
#include <cstdint>

namespace metamat {
namespace io {

struct StageMemory {
  unsigned char* p = nullptr;
  int64_t bytes = 0;    // allocated size (a multiple of 4 KiB)
  bool pinned = false;  // page-locked (cudaHostAlloc) on `device`, else posix_memalign
  int device = -1;
};

// A buffer of at least `bytes` (rounded up to 4 KiB, 4 KiB aligned): cached or new. Throws
// CoreError when allocation fails.
StageMemory stage_take(int64_t bytes, bool pinned, int device);
// Gives `m` back at the close of pipeline `ring_id`: cached (dropping buffers of other rings)
// or freed. Never throws.
void stage_give_back(const StageMemory& m, int64_t ring_id) noexcept;
// A new ring id (one per pipeline).
int64_t stage_new_ring_id();

struct StagePoolStats {
  int64_t cached_buffers = 0, cached_bytes = 0;
  int64_t hits = 0, misses = 0;  // stage_take calls served from the cache / allocating
};
StagePoolStats stage_pool_stats();
// Frees every cached buffer; returns the bytes freed. Never throws.
int64_t stage_free_cached() noexcept;

}  // namespace io
}  // namespace metamat
