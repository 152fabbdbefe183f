// CPU backend of the init engine: validates the segments, picks the kernel for this CPU
// (AVX-512, AVX2 or baseline x86-64), and lets threads take spans of the concatenated
// elements from a shared counter; each span is a (segment, element range) walk. Pages not yet mapped are
// prefaulted in batches: by a helper thread ahead of a single writer, or by each writer for
// its next span (fill_cpu_prefault.h).
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "metamat/check.h"
#include "fill_cpu.h"
#include "fill_cpu_prefault.h"
#include "metamat/detail/thread_group.h"

namespace metamat {
namespace {

using SpanFn = void (*)(const Segment&, int64_t, int64_t);

enum class Isa { kBase = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_runs(Isa isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  switch (isa) {
    case Isa::kAvx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    case Isa::kAvx2: return avx2;
    default: return true;
  }
}

// AMD family 0x19 is Zen 3 and Zen 4; of those only Zen 4 has AVX-512, and it executes each
// 512-bit operation as two 256-bit halves. Whether the AVX-512 kernel (16 lanes, 32 vector
// registers: no spills, two passes in lockstep) or the AVX2 kernel is faster there is not
// known here (no Zen 4 to measure on): on such a CPU both are timed once (measure_isa). On
// Intel the AVX-512 kernel is 1.3-1.7x the AVX2 one (Xeon "Emerald Rapids",
// docs/PERFORMANCE.md); Zen 5 (family 0x1A) has full-width 512-bit units: both keep the
// fixed rule, which gives the same choice on every run and every rank.
bool amd_family_19h() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // AuthenticAMD
  if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return false;
  unsigned family = (a >> 8) & 0xFu;
  if (family == 0xFu) family += (a >> 20) & 0xFFu;
  return family == 0x19u;
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "x86-64";
}

SpanFn span_fn(Isa isa) {
  return isa == Isa::kAvx512 ? isa_avx512::fill_span
         : isa == Isa::kAvx2 ? isa_avx2::fill_span
                             : isa_base::fill_span;
}

// The kernel called `name`, if this CPU runs it; `source` says where the name came from.
Isa named_isa(const std::string& name, const std::string& source) {
  const Isa isa = name == "avx512" ? Isa::kAvx512
                  : name == "avx2" ? Isa::kAvx2
                  : name == "x86-64" ? Isa::kBase
                                     : static_cast<Isa>(-1);
  MM_CHECK(isa == Isa::kAvx512 || isa == Isa::kAvx2 || isa == Isa::kBase,
           source + "unknown CPU kernel '" + name + "' (avx512, avx2, x86-64" +
               (source.empty() ? ")" : ", measure)"));
  MM_CHECK(cpu_runs(isa), source + "this CPU cannot run the '" + name + "' kernel");
  return isa;
}

// The kernel in use and why it was chosen (cpu_kernel_choice).
struct Choice {
  Isa isa;
  std::string why;
};

// Times the AVX-512 and AVX2 kernels on this core and returns the faster: 32 KiB (cache
// resident: the kernels' arithmetic, not page faults) filled with Uniform and with Normal,
// 9 rounds alternating which kernel goes first, the best round of each (other work on the
// machine only adds time). The values are the same with either kernel, so a choice made on a
// busy machine costs speed, never correctness. ~1 ms, once per process. AVX-512 must win by
// 3%: a tie keeps the AVX2 kernel, the fixed rule's choice before this measurement existed.
// Only fp32 Uniform (Philox-bound) and Normal (transform-bound) are timed: TruncatedNormal
// and 16-bit stores follow the same kernel.
Choice measure_isa() {
  if (!cpu_runs(Isa::kAvx512)) {
    const Isa only = cpu_runs(Isa::kAvx2) ? Isa::kAvx2 : Isa::kBase;
    return {only, std::string("measure: only ") + isa_name(only) + " runs here, nothing timed"};
  }
  constexpr int64_t kRows = 32, kCols = 256;
  alignas(64) static float buf[kRows * kCols];  // runs once (choice()); the core allocates nothing
  Segment seg[2] = {};
  for (int i = 0; i < 2; ++i) {
    seg[i].ptr = reinterpret_cast<uint64_t>(buf);
    seg[i].rows = kRows, seg[i].cols = kCols, seg[i].row_stride = kCols;
    seg[i].key = 0x6d6561737572ull + i;
    seg[i].dtype = int32_t(DType::kFloat32);
    seg[i].dist.kind = int32_t(i == 0 ? DistKind::kUniform : DistKind::kNormal);
    seg[i].dist.p0 = i == 0 ? -1.0f : 0.0f, seg[i].dist.p1 = i == 0 ? 2.0f : 1.0f;
  }
  const Isa isas[2] = {Isa::kAvx512, Isa::kAvx2};
  double best[2] = {1e30, 1e30};
  for (int round = 0; round < 9; ++round)
    for (int j = 0; j < 2; ++j) {
      const int k = (round + j) % 2;
      const SpanFn fn = span_fn(isas[k]);
      const auto t0 = std::chrono::steady_clock::now();
      for (const Segment& s : seg) fn(s, 0, kRows * kCols);
      const std::chrono::duration<double, std::micro> dt = std::chrono::steady_clock::now() - t0;
      best[k] = std::min(best[k], dt.count());
    }
  const Isa pick = best[0] < 0.97 * best[1] ? Isa::kAvx512 : Isa::kAvx2;
  char why[160];
  std::snprintf(why, sizeof why,
                "measured: avx512 %.1f us, avx2 %.1f us per 32 KiB of Uniform and of Normal",
                best[0], best[1]);
  return {pick, why};
}

// METAMAT_CPU_KERNEL=avx512|avx2|x86-64 replaces the rule, =measure times the SIMD kernels
// on any CPU; a name this CPU cannot run is an error, not ignored.
Choice pick_isa() {
  const char* forced = std::getenv("METAMAT_CPU_KERNEL");
  if (forced != nullptr && *forced != '\0') {
    if (std::string(forced) == "measure") return measure_isa();
    return {named_isa(forced, "METAMAT_CPU_KERNEL: "), "METAMAT_CPU_KERNEL"};
  }
  if (cpu_runs(Isa::kAvx512)) {
    if (amd_family_19h()) return measure_isa();
    return {Isa::kAvx512, "CPUID: AVX-512"};
  }
  if (cpu_runs(Isa::kAvx2)) return {Isa::kAvx2, "CPUID: AVX2, no AVX-512"};
  return {Isa::kBase, "CPUID: no AVX2"};
}

const Choice& choice() {
  static const Choice c = pick_isa();
  return c;
}

// "" -> the picked kernel; a name -> that kernel, if this CPU runs it.
Isa isa_by_name(const std::string& name) {
  if (name.empty()) return choice().isa;
  return named_isa(name, "");
}

// Spans of at most this many elements (1 MiB of fp32): the unit of progress reports to the
// prefault helper and of a writer's own prefaulting (a span is ~1 ms of work at most).
constexpr int64_t kSpanElems = int64_t{1} << 18;

// Elements [begin, end) of the concatenation of all segments (each row-major). Stores the
// index of the next element to write into `progress` after each span, when given; prefaults
// each span first when `prefault`.
void fill_elements(SpanFn fn, const Segment* segs, const std::vector<int64_t>& seg_begin,
                   int64_t begin, int64_t end, std::atomic<int64_t>* progress, bool prefault) {
  int64_t si =
      std::upper_bound(seg_begin.begin(), seg_begin.end(), begin) - seg_begin.begin() - 1;
  while (begin < end) {
    const int64_t stop = std::min(end, seg_begin[si + 1]);
    while (begin < stop) {
      const int64_t n = std::min(kSpanElems, stop - begin);
      const int64_t b = begin - seg_begin[si];
      if (prefault) prefault_span(segs[si], b, b + n);
      fn(segs[si], b, b + n);
      begin += n;
      if (progress) progress->store(begin, std::memory_order_release);
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
  MM_CHECK(s.dtype >= int32_t(DType::kFloat32) && s.dtype <= int32_t(DType::kFloat64),
           at + "unknown dtype code");
  MM_CHECK(s.dist.kind >= 0 && s.dist.kind <= 3, at + "unknown distribution code");
}

// philox.h / dtype.h, element by element: what the kernels' math must equal.
void math_apply_scalar(MathFn fn, const void* in, void* out, int64_t n) {
  const uint32_t* iu = static_cast<const uint32_t*>(in);
  float* of = static_cast<float*>(out);
  uint16_t* oh = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    switch (fn) {
      case MathFn::kLog: of[i] = mm_logf(bits_to_float(iu[i])); break;
      case MathFn::kErfinv: of[i] = mm_erfinvf(bits_to_float(iu[i])); break;
      case MathFn::kSinCos: mm_sincos_turns(iu[i] >> 8, &of[2 * i], &of[2 * i + 1]); break;
      case MathFn::kBoxMuller:
        box_muller(iu[2 * i], iu[2 * i + 1], &of[2 * i], &of[2 * i + 1]);
        break;
      case MathFn::kToF16: oh[i] = f32_to_f16(bits_to_float(iu[i])); break;
      case MathFn::kToBF16: oh[i] = f32_to_bf16(bits_to_float(iu[i])); break;
    }
  }
}

}  // namespace

const char* cpu_kernel_name() { return isa_name(isa_by_name("")); }

std::string cpu_kernel_choice() { return choice().why; }

std::vector<std::string> cpu_kernels_runnable() {
  std::vector<std::string> names;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kBase})
    if (cpu_runs(isa)) names.push_back(isa_name(isa));
  return names;
}

void cpu_math(const std::string& fn_name, const std::string& isa_name_, const void* in,
              void* out, int64_t n) {
  static const char* const kNames[] = {"log", "sincos", "box_muller", "erfinv", "f16", "bf16"};
  int f = 0;
  while (f < 6 && fn_name != kNames[f]) ++f;
  MM_CHECK(f < 6, "unknown math function '" + fn_name + "'");
  MM_CHECK(n >= 0, "negative count");
  const MathFn fn = static_cast<MathFn>(f);
  if (isa_name_ == "scalar") return math_apply_scalar(fn, in, out, n);
  const Isa isa = isa_by_name(isa_name_);
  if (isa == Isa::kAvx512) return isa_avx512::math_apply(fn, in, out, n);
  if (isa == Isa::kAvx2) return isa_avx2::math_apply(fn, in, out, n);
  return isa_base::math_apply(fn, in, out, n);
}

void fill_cpu(const Segment* segs, int64_t n, int num_threads, const std::string& isa) {
  const SpanFn fn = span_fn(isa_by_name(isa));
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
  if (nt == 1) {
    // One writer: a helper thread prefaults the pages it will reach next (stopped and joined
    // by its destructor, on return or exception).
    std::atomic<int64_t> progress{0};
    PrefaultAhead helper(segs, seg_begin, &progress);
    fill_elements(fn, segs, seg_begin, 0, total, helper.active() ? &progress : nullptr,
                  false);
    return;
  }
  // Several writers take spans from a shared counter, not fixed shares: a thread whose core
  // is busy with other work (a shared machine, an efficiency core) then does less of it, and
  // the fill is never slower than with one thread. Spans start at multiples of kSpanElems
  // (a multiple of 64): threads never share a pass or a cache line.
  const bool prefault = prefault_enabled();
  std::atomic<int64_t> next{0};
  std::vector<std::exception_ptr> errors(nt);
  auto work = [&](int t) {
    try {
      for (int64_t b; (b = next.fetch_add(kSpanElems, std::memory_order_relaxed)) < total;)
        fill_elements(fn, segs, seg_begin, b, std::min(total, b + kSpanElems), nullptr,
                      prefault);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  {
    // Threads that could not be started (thread limit reached) leave their spans to the
    // others; the group joins on every path (a joinable std::thread destroyed during
    // unwinding is std::terminate: "terminate called without an active exception").
    ThreadGroup group;
    for (int t = 1; t < nt; ++t)
      if (!group.spawn([&work, t] { work(t); })) break;
    work(0);
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace metamat
