// Batched page faults: see io_prefault.h.
#include "io_prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 uapi value; older kernels answer EINVAL
#endif

namespace metamat {
namespace {

constexpr int64_t kSpanMinBytes = int64_t{256} << 10;  // smaller spans: not worth a syscall

// Whether this kernel knows MADV_POPULATE_WRITE, probed once on a page of our own (an EINVAL
// later may come from the caller's memory, e.g. a PFN map, and only skips that range).
bool populate_supported() {
  static const bool ok = [] {
    const uintptr_t page = prefault_page_size();
    void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    const bool works = madvise(p, page, MADV_POPULATE_WRITE) == 0;
    munmap(p, page);
    return works;
  }();
  return ok;
}

}  // namespace

uintptr_t prefault_page_size() {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return page;
}

bool prefault_enabled() {
  const char* v = std::getenv("METAMAT_PREFAULT");
  return (v == nullptr || std::strcmp(v, "0") != 0) && populate_supported();
}

bool page_mapped(uintptr_t p) {
  unsigned char v = 0;
  return mincore(reinterpret_cast<void*>(p), prefault_page_size(), &v) == 0 && (v & 1);
}

void prefault_bytes(void* p, int64_t n) {
  if (n < kSpanMinBytes) return;
  const uintptr_t page = prefault_page_size();
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n)) & ~(page - 1);
  if (hi < lo + kSpanMinBytes || !prefault_enabled() || page_mapped(lo)) return;
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);  // on error: write faults
}

}  // namespace metamat
