// Prefaulting the destination of a CPU fill: batched page faults, overlapped when possible.
//
// A fresh destination (torch.empty of a large tensor, an anonymous map from
// metamat/allocate.py) has no pages yet: the writer takes one page fault per 4 KiB page, and
// faulting costs as much as generating the values. madvise(MADV_POPULATE_WRITE) (Linux 5.14)
// maps a whole range in one call, which is cheaper than one trap per page (measured on this
// project's VM: 2 GiB memset 1.8-1.9 s, populate + memset 1.1-1.5 s).
// - One writer thread: a helper thread (PrefaultAhead) populates the chunks just ahead of the
//   writer, so faulting overlaps generation where a core is free, and is batched where not.
// - Several writer threads: each populates its next span itself (prefault_span), batched.
//
// Safety: only whole pages inside the bytes the fill writes are populated (contiguous segments,
// page-aligned inward); population never writes a byte (it maps the same zero, file or
// copied-on-write contents the writer's own fault would); any error just leaves the faults to
// the writer (an EINVAL from a kernel without MADV_POPULATE_WRITE is probed once per process).
// Ranges whose first page is already mapped are skipped (one mincore call). The helper is
// stopped and joined by its destructor on every path. METAMAT_PREFAULT=0 turns all of it off.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "metamat/fill.h"
#include "io/io_prefault.h"  // prefault_enabled, page_mapped, prefault_bytes (the reader's)

namespace metamat {

// Populates the whole pages of elements [begin, end) of segment s (row-major offsets) if s is
// contiguous, the range is at least a few pages and its first page is not mapped yet.
void prefault_span(const Segment& s, int64_t begin, int64_t end);

// A helper thread that populates the destination just ahead of a single writer.
class PrefaultAhead {
 public:
  // Starts the helper when prefaulting is enabled and the contiguous part of the destination
  // is large enough. `seg_begin[i]` is the index of segment i's first element in the writer's
  // order; `progress` is where the writer stores the index of the next element it will write.
  PrefaultAhead(const Segment* segs, const std::vector<int64_t>& seg_begin,
                const std::atomic<int64_t>* progress);
  ~PrefaultAhead();
  PrefaultAhead(const PrefaultAhead&) = delete;
  PrefaultAhead& operator=(const PrefaultAhead&) = delete;

  // True when a helper thread runs (the writer then reports progress).
  bool active() const { return thread_.joinable(); }

 private:
  struct Chunk {
    uintptr_t lo, hi;  // page-aligned bytes [lo, hi)
    int64_t first;     // writer element index of byte lo
    int64_t lead;      // populate once the writer is this many elements before `first`
  };
  void run();

  std::vector<Chunk> chunks_;
  const std::atomic<int64_t>* progress_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace metamat
