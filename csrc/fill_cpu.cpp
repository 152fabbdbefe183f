// CPU backend of the init engine: validates the segments, picks the widest kernel this CPU
// runs (AVX-512, AVX2 or baseline x86-64), and splits the total element count evenly over
// threads; each thread walks its (segment, row, column) range.
#include <algorithm>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "fill.h"

namespace metamat {
namespace isa_avx512 { void fill_range(const Segment&, int64_t, int64_t, int64_t); }
namespace isa_avx2 { void fill_range(const Segment&, int64_t, int64_t, int64_t); }
namespace isa_base { void fill_range(const Segment&, int64_t, int64_t, int64_t); }

namespace {

using RangeFn = void (*)(const Segment&, int64_t, int64_t, int64_t);

RangeFn pick_kernel() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return isa_avx512::fill_range;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return isa_avx2::fill_range;
  return isa_base::fill_range;
}

// Elements [begin, end) of the concatenation of all segments (each row-major).
void fill_elements(RangeFn fn, const Segment* segs, const std::vector<int64_t>& seg_begin,
                   int64_t begin, int64_t end) {
  int64_t si =
      std::upper_bound(seg_begin.begin(), seg_begin.end(), begin) - seg_begin.begin() - 1;
  while (begin < end) {
    const Segment& s = segs[si];
    const int64_t stop = std::min(end, seg_begin[si + 1]);
    const int64_t off = begin - seg_begin[si];
    int64_t r = s.cols ? off / s.cols : 0, c = s.cols ? off % s.cols : 0;
    while (begin < stop) {
      const int64_t n = std::min(s.cols - c, stop - begin);
      fn(s, r, c, c + n);
      begin += n;
      ++r;
      c = 0;
    }
    ++si;
  }
}

void validate(const Segment& s, int64_t i) {
  const std::string at = "segment " + std::to_string(i) + ": ";
  MM_CHECK(s.rows >= 0 && s.cols >= 0, at + "negative size");
  MM_CHECK(s.rows == 0 || s.cols == 0 || s.ptr != 0, at + "null pointer");
  MM_CHECK(s.rows <= 1 || s.row_stride >= s.cols, at + "row stride smaller than cols");
  MM_CHECK(s.row_offset >= 0 && s.col_offset >= 0, at + "negative global offset");
  MM_CHECK(s.dtype >= 0 && s.dtype <= 3, at + "unknown dtype code");
  MM_CHECK(s.dist.kind >= 0 && s.dist.kind <= 3, at + "unknown distribution code");
}

}  // namespace

const char* cpu_kernel_name() {
  RangeFn fn = pick_kernel();
  return fn == isa_avx512::fill_range ? "avx512" : fn == isa_avx2::fill_range ? "avx2" : "x86-64";
}

namespace {

RangeFn kernel_by_name(const std::string& isa) {
  if (isa.empty()) {
    static const RangeFn best = pick_kernel();
    return best;
  }
  RangeFn best = pick_kernel();
  RangeFn want = isa == "avx512" ? isa_avx512::fill_range
                 : isa == "avx2" ? isa_avx2::fill_range
                 : isa == "x86-64" ? isa_base::fill_range : nullptr;
  MM_CHECK(want != nullptr, "unknown CPU kernel '" + isa + "' (avx512, avx2, x86-64)");
  // Never run an instruction set this CPU lacks.
  const int rank_best = best == isa_avx512::fill_range ? 2 : best == isa_avx2::fill_range ? 1 : 0;
  const int rank_want = isa == "avx512" ? 2 : isa == "avx2" ? 1 : 0;
  MM_CHECK(rank_want <= rank_best, "this CPU cannot run the '" + isa + "' kernel");
  return want;
}

}  // namespace

void fill_cpu(const Segment* segs, int64_t n, int num_threads, const std::string& isa) {
  const RangeFn fn = kernel_by_name(isa);
  std::vector<int64_t> seg_begin(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    validate(segs[i], i);
    seg_begin[i + 1] = seg_begin[i] + segs[i].rows * segs[i].cols;
  }
  const int64_t total = seg_begin[n];
  if (total == 0) return;
  // Below ~1 MB per thread, starting a thread costs more than it saves.
  const int64_t useful = std::max<int64_t>(1, total / (256 * 1024));
  const int nt = static_cast<int>(std::clamp<int64_t>(num_threads, 1, useful));
  // Split on multiples of 64 elements: threads never share a pass or a cache line.
  auto split = [&](int t) { return t == nt ? total : (total * t / nt) & ~int64_t{63}; };
  std::vector<std::exception_ptr> errors(nt);
  std::vector<std::thread> workers;
  workers.reserve(nt - 1);
  auto work = [&](int t) {
    try {
      fill_elements(fn, segs, seg_begin, split(t), split(t + 1));
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  for (int t = 1; t < nt; ++t) workers.emplace_back(work, t);
  work(0);
  for (auto& w : workers) w.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace metamat
