// Prefaulting a fill's destination: see fill_cpu_prefault.h.
#include "fill_cpu_prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 uapi value; older kernels answer EINVAL
#endif

namespace metamat {
namespace {

constexpr int64_t kChunkBytes = int64_t{2} << 20;    // helper: bytes per madvise call
constexpr int64_t kAheadBytes = int64_t{16} << 20;   // helper: lead over the writer (in L3)
constexpr int64_t kHelperMinBytes = int64_t{32} << 20;  // smaller fills: not worth a thread
constexpr int64_t kSpanMinBytes = int64_t{256} << 10;   // smaller spans: not worth a syscall

uintptr_t page_size() { return prefault_page_size(); }
bool page_resident(uintptr_t p) { return page_mapped(p); }

// The whole pages of elements [begin, end) of a contiguous segment (lo >= hi when none).
void page_range(const Segment& s, int64_t begin, int64_t end, uintptr_t* lo, uintptr_t* hi) {
  const uintptr_t page = page_size();
  const uintptr_t es = static_cast<uintptr_t>(dtype_size(static_cast<DType>(s.dtype)));
  *lo = (s.ptr + static_cast<uintptr_t>(begin) * es + page - 1) & ~(page - 1);
  *hi = (s.ptr + static_cast<uintptr_t>(end) * es) & ~(page - 1);
}

bool contiguous(const Segment& s) { return s.rows <= 1 || s.row_stride == s.cols; }

}  // namespace

void prefault_span(const Segment& s, int64_t begin, int64_t end) {
  if (!contiguous(s)) return;  // strided rows leave gaps the fill does not write
  uintptr_t lo, hi;
  page_range(s, begin, end, &lo, &hi);
  if (hi < lo + kSpanMinBytes || page_resident(lo)) return;
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);  // on error: write faults
}

PrefaultAhead::PrefaultAhead(const Segment* segs, const std::vector<int64_t>& seg_begin,
                             const std::atomic<int64_t>* progress)
    : progress_(progress) {
  int64_t bytes = 0;
  for (size_t i = 0; i + 1 < seg_begin.size(); ++i) {
    const Segment& s = segs[i];
    const int64_t elems = s.rows * s.cols;
    if (elems == 0 || !contiguous(s)) continue;
    const int64_t es = dtype_size(static_cast<DType>(s.dtype));
    uintptr_t lo, hi;
    page_range(s, 0, elems, &lo, &hi);
    for (uintptr_t c = lo; c < hi; c += kChunkBytes) {
      const uintptr_t ce = std::min<uintptr_t>(hi, c + kChunkBytes);
      chunks_.push_back({c, ce, seg_begin[i] + static_cast<int64_t>(c - s.ptr) / es,
                         kAheadBytes / es});
      bytes += static_cast<int64_t>(ce - c);
    }
  }
  // A destination already mapped at its start, middle and end (a pre-touched buffer) leaves
  // the helper nothing to do: do not start it.
  const bool mapped = !chunks_.empty() && page_resident(chunks_.front().lo) &&
                      page_resident(chunks_[chunks_.size() / 2].lo) &&
                      page_resident(chunks_.back().lo);
  if (bytes < kHelperMinBytes || mapped || !prefault_enabled()) {
    chunks_.clear();
    return;
  }
  try {
    thread_ = std::thread(&PrefaultAhead::run, this);
  } catch (...) {  // no thread: the writer faults its pages itself
    chunks_.clear();
  }
}

PrefaultAhead::~PrefaultAhead() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

void PrefaultAhead::run() {
  for (const Chunk& c : chunks_) {
    for (;;) {  // wait until the writer is within `lead` elements of this chunk
      if (stop_.load(std::memory_order_acquire)) return;
      const int64_t at = progress_->load(std::memory_order_acquire);
      if (at >= c.first) break;  // the writer got here first: it faults this chunk itself
      if (c.first - at <= c.lead) {
        if (page_resident(c.lo)) break;
        if (madvise(reinterpret_cast<void*>(c.lo), c.hi - c.lo, MADV_POPULATE_WRITE) != 0 &&
            errno != EAGAIN)
          return;  // not populatable here (EINVAL, ENOMEM, EFAULT, ...): the writer faults
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

}  // namespace metamat
