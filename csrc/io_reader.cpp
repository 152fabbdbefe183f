// Thread-pool pread executor for checkpoint read plans. See io_reader.h.
#include "io_reader.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

namespace metamat {
namespace io {

namespace {

// ---- element conversion (round to nearest even, matching c10's scalar conversions) ----

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp16 <-> fp32, from the FP16 library (as vendored in c10/util/Half.h).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = bits_f32((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = bits_f32((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
  return bits_f32(result);
}

inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  const uint32_t w = f32_bits(f);
  float base = (bits_f32(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_f32(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

// c10::detail::round_to_nearest_even, written branch-free so the loop vectorises.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return uint16_t(nan ? 0x7FC0u : rounded);
}

inline float load_as_f32(const unsigned char* p, DType t) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == DType::kF16 ? f16_to_f32(h) : bf16_to_f32(h);
}

inline void store_f32(unsigned char* p, DType t, float f) {
  if (t == DType::kF32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = t == DType::kF16 ? f32_to_f16(f) : f32_to_bf16(f);
  std::memcpy(p, &h, 2);
}

// Specialised loops so the common cases vectorise (the switch is hoisted out of the loop).
template <DType S, DType D>
inline __attribute__((always_inline)) void convert_loop(const unsigned char* src, unsigned char* dst, int64_t n) {
  constexpr int64_t ss = S == DType::kF32 ? 4 : 2;
  constexpr int64_t ds = D == DType::kF32 ? 4 : 2;
  for (int64_t i = 0; i < n; ++i) store_f32(dst + i * ds, D, load_as_f32(src + i * ss, S));
}

// ---- I/O helpers ----

// ---- fault injection (tests only; see io_reader.h) ----

enum class FaultMode { kNone, kEio, kShort, kEof, kEintr };

struct Fault {
  FaultMode mode = FaultMode::kNone;
  int64_t nth = 0;                 // 1-based index of the pread call that misbehaves
  std::atomic<int64_t> calls{0};   // pread calls made so far in this execute_reads
};

// METAMAT_IO_FAULT="<k>:<eio|short|eof|eintr>"; anything else (or unset) disables it.
void parse_fault(Fault& f) {
  const char* v = std::getenv("METAMAT_IO_FAULT");
  if (v == nullptr || *v == 0) return;
  char* end = nullptr;
  const long long k = std::strtoll(v, &end, 10);
  if (end == v || *end != ':' || k < 1) return;
  const std::string m(end + 1);
  f.nth = k;
  f.mode = m == "eio" ? FaultMode::kEio : m == "short" ? FaultMode::kShort
         : m == "eof" ? FaultMode::kEof : m == "eintr" ? FaultMode::kEintr : FaultMode::kNone;
}

// ::pread, unless this is the call the fault plan picks.
ssize_t pread_hook(Fault* fault, int fd, void* buf, size_t want, off_t off) {
  if (fault != nullptr && fault->mode != FaultMode::kNone &&
      fault->calls.fetch_add(1) + 1 == fault->nth) {
    switch (fault->mode) {
      case FaultMode::kEio: errno = EIO; return -1;
      case FaultMode::kEintr: errno = EINTR; return -1;
      case FaultMode::kEof: return 0;
      case FaultMode::kShort: return ::pread(fd, buf, want > 1 ? want / 2 : want, off);
      case FaultMode::kNone: break;
    }
  }
  return ::pread(fd, buf, want, off);
}

// pread exactly `len` bytes; returns "" or an error message. Loops on short reads and EINTR.
std::string pread_full(int fd, void* buf, int64_t len, int64_t off, Fault* fault) {
  auto* p = static_cast<unsigned char*>(buf);
  while (len > 0) {
    const size_t want = size_t(std::min<int64_t>(len, int64_t(1) << 30));
    const ssize_t got = pread_hook(fault, fd, p, want, off_t(off));
    if (got < 0) {
      if (errno == EINTR) continue;
      return std::string("pread failed at offset ") + std::to_string(off) + ": " +
             std::strerror(errno);
    }
    if (got == 0) return "unexpected end of file at offset " + std::to_string(off);
    p += got;
    off += got;
    len -= got;
  }
  return {};
}

// Bounce-buffer work is done in pieces that stay in L2, so the scatter/convert pass reads
// from cache rather than memory.
constexpr int64_t kCacheBytes = int64_t(256) << 10;

struct Task {
  int64_t op;
  int64_t row0, rows;        // row range (strided ops)
  int64_t byte0, bytes;      // byte range within the row (rows == 1 ops split by bytes)
};

bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

struct Runner {
  const std::vector<std::string>& files;
  const std::vector<int>& fds;
  const ReadOp* ops;
  const ReadOptions& opt;
  std::vector<Task> tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> bytes_read{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::string error;
  int64_t failed_op = -1;
  Fault* fault = nullptr;

  Runner(const std::vector<std::string>& f, const std::vector<int>& d, const ReadOp* o,
         const ReadOptions& p)
      : files(f), fds(d), ops(o), opt(p) {}

  void fail(int64_t op, const std::string& msg) {
    std::lock_guard<std::mutex> lock(mu);
    if (!failed.exchange(true)) {
      failed_op = op;
      const ReadOp& o = ops[op];
      error = "file " + files[size_t(o.file_index)] + ", read op " + std::to_string(op) + ": " +
              msg;
    }
  }

  // Read rows [row0, row0+rows) of a strided op through the bounce buffer, converting or
  // scattering into the destination.
  std::string bounce_rows(const ReadOp& o, int64_t row0, int64_t rows, unsigned char* bounce,
                          int64_t cap) {
    cap = std::min(cap, kCacheBytes);
    const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
    const bool conv = s != d;
    const int64_t ssz = conv ? dtype_size(s) : 1;
    const int64_t dsz = conv ? dtype_size(d) : 1;
    const int fd = fds[size_t(o.file_index)];
    const bool coalesce = rows > 1 && opt.coalesce_gap >= 0 &&
                          o.src_stride - o.row_bytes <= opt.coalesce_gap && o.src_stride <= cap;
    int64_t r = row0;
    const int64_t end = row0 + rows;
    while (r < end) {
      if (failed.load(std::memory_order_relaxed)) return {};
      if (coalesce) {
        // k rows in one span: (k-1)*stride + row_bytes bytes.
        int64_t k = std::min<int64_t>(end - r, (cap - o.row_bytes) / o.src_stride + 1);
        const int64_t span = (k - 1) * o.src_stride + o.row_bytes;
        std::string e = pread_full(fd, bounce, span, o.file_offset + r * o.src_stride, fault);
        if (!e.empty()) return e;
        bytes_read += span;
        for (int64_t i = 0; i < k; ++i) {
          unsigned char* dst = reinterpret_cast<unsigned char*>(o.dst) + (r + i) * o.dst_stride;
          const unsigned char* src = bounce + i * o.src_stride;
          if (conv) convert(src, s, dst, d, o.row_bytes / ssz);
          else std::memcpy(dst, src, size_t(o.row_bytes));
        }
        r += k;
      } else {
        // One row (or a piece of a row longer than the buffer) at a time.
        unsigned char* dst_row = reinterpret_cast<unsigned char*>(o.dst) + r * o.dst_stride;
        const int64_t src_row = o.file_offset + r * o.src_stride;
        if (!conv) {
          std::string e = pread_full(fd, dst_row, o.row_bytes, src_row, fault);
          if (!e.empty()) return e;
          bytes_read += o.row_bytes;
        } else {
          const int64_t piece = std::max<int64_t>(ssz, cap / ssz * ssz);
          for (int64_t b = 0; b < o.row_bytes; b += piece) {
            const int64_t len = std::min(piece, o.row_bytes - b);
            std::string e = pread_full(fd, bounce, len, src_row + b, fault);
            if (!e.empty()) return e;
            bytes_read += len;
            convert(bounce, s, dst_row + b / ssz * dsz, d, len / ssz);
          }
        }
        ++r;
      }
    }
    return {};
  }

  std::string run_task(const Task& t, unsigned char* bounce, int64_t cap) {
    const ReadOp& o = ops[t.op];
    const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
    if (o.rows == 1) {
      if (s == d) {
        std::string e = pread_full(fds[size_t(o.file_index)],
                                   reinterpret_cast<unsigned char*>(o.dst) + t.byte0, t.bytes,
                                   o.file_offset + t.byte0, fault);
        if (e.empty()) bytes_read += t.bytes;
        return e;
      }
      const int64_t ssz = dtype_size(s), dsz = dtype_size(d);
      const int64_t piece = std::max<int64_t>(ssz, std::min(cap, kCacheBytes) / ssz * ssz);
      for (int64_t b = t.byte0; b < t.byte0 + t.bytes; b += piece) {
        if (failed.load(std::memory_order_relaxed)) return {};
        const int64_t len = std::min(piece, t.byte0 + t.bytes - b);
        std::string e =
            pread_full(fds[size_t(o.file_index)], bounce, len, o.file_offset + b, fault);
        if (!e.empty()) return e;
        bytes_read += len;
        convert(bounce, s, reinterpret_cast<unsigned char*>(o.dst) + b / ssz * dsz, d,
                len / ssz);
      }
      return {};
    }
    return bounce_rows(o, t.row0, t.rows, bounce, cap);
  }

  void worker() {
    std::unique_ptr<unsigned char[]> bounce;
    // Clamped: a huge request (the option is caller-supplied) must not abort the process.
    int64_t cap = std::min<int64_t>(std::max<int64_t>(opt.bounce_bytes, 64), int64_t(1) << 30);
    cap -= cap % 4;  // whole elements of every dtype
    try {
      bounce.reset(new unsigned char[size_t(cap)]);
    } catch (const std::bad_alloc&) {
      fail(0, "cannot allocate the bounce buffer");
      return;
    }
    for (;;) {
      if (failed.load(std::memory_order_relaxed)) return;
      const int64_t i = next.fetch_add(1);
      if (i >= int64_t(tasks.size())) return;
      std::string e;
      try {
        e = run_task(tasks[size_t(i)], bounce.get(), cap);
      } catch (const std::exception& ex) {
        e = ex.what();
      }
      if (!e.empty()) {
        fail(tasks[size_t(i)].op, e);
        return;
      }
    }
  }
};

// Closes file descriptors on every path.
struct FdSet {
  std::vector<int> fds;
  ~FdSet() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
};

// Joins threads on every path (including an exception while starting them).
struct Joiner {
  std::vector<std::thread> threads;
  ~Joiner() {
    for (auto& t : threads)
      if (t.joinable()) t.join();
  }
};

}  // namespace

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    default: return 0;
  }
}

// Built twice (AVX2 and baseline) and picked at load time: conversion is the only compute.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void convert_impl(const unsigned char* in, DType s, unsigned char* out, DType d,
                         int64_t n) {
#define MM_CONV(S, D) \
  if (s == DType::S && d == DType::D) return convert_loop<DType::S, DType::D>(in, out, n);
  MM_CONV(kF32, kF16) MM_CONV(kF32, kBF16) MM_CONV(kF16, kF32) MM_CONV(kBF16, kF32)
  MM_CONV(kF16, kBF16) MM_CONV(kBF16, kF16) MM_CONV(kF32, kF32) MM_CONV(kF16, kF16)
  MM_CONV(kBF16, kBF16)
#undef MM_CONV
}

void convert(const void* src, DType s, void* dst, DType d, int64_t n) {
  convert_impl(static_cast<const unsigned char*>(src), s, static_cast<unsigned char*>(dst), d, n);
}

ReadResult execute_reads(const std::vector<std::string>& files, const ReadOp* ops, int64_t n,
                         const ReadOptions& opt) {
  ReadResult res;
  auto bad = [&](int64_t i, const std::string& msg) {
    res.ok = false;
    res.failed_op = i;
    const bool has_file = i >= 0 && ops[i].file_index >= 0 &&
                          ops[i].file_index < int64_t(files.size());
    res.error = (has_file ? "file " + files[size_t(ops[i].file_index)] + ", " : std::string()) +
                (i >= 0 ? "read op " + std::to_string(i) + ": " : std::string()) + msg;
    return res;
  };
  if (n < 0 || (n > 0 && ops == nullptr)) return bad(-1, "bad op array");

  // 1. Validate every op against the files before any byte is written.
  FdSet fdset;
  fdset.fds.assign(files.size(), -1);
  std::vector<int64_t> sizes(files.size(), -1);
  for (int64_t i = 0; i < n; ++i) {
    const ReadOp& o = ops[i];
    if (o.file_index < 0 || o.file_index >= int64_t(files.size()))
      return bad(i, "file index " + std::to_string(o.file_index) + " out of range");
    const size_t fi = size_t(o.file_index);
    if (fdset.fds[fi] < 0) {
      const int fd = ::open(files[fi].c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return bad(i, std::string("cannot open: ") + std::strerror(errno));
      fdset.fds[fi] = fd;
      struct stat st;
      if (::fstat(fd, &st) != 0) return bad(i, std::string("fstat: ") + std::strerror(errno));
      sizes[fi] = int64_t(st.st_size);
    }
    if (o.rows < 0 || o.row_bytes < 0 || o.file_offset < 0 || o.src_stride < 0)
      return bad(i, "negative size, offset or stride");
    const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
    if (s != d && !(is_float(s) && is_float(d)))
      return bad(i, "unsupported conversion " + std::to_string(o.src_dtype) + " -> " +
                        std::to_string(o.dst_dtype));
    if (s != d && o.row_bytes % dtype_size(s) != 0)
      return bad(i, "row bytes not a whole number of source elements");
    if (o.rows == 0 || o.row_bytes == 0) continue;
    if (o.dst == 0) return bad(i, "null destination");
    if (o.rows > 1 && o.src_stride < o.row_bytes) return bad(i, "source rows overlap");
    // end = file_offset + (rows-1)*src_stride + row_bytes, overflow-checked.
    int64_t end;
    if (__builtin_mul_overflow(o.rows - 1, o.src_stride, &end) ||
        __builtin_add_overflow(end, o.row_bytes, &end) ||
        __builtin_add_overflow(end, o.file_offset, &end))
      return bad(i, "byte range overflows int64");
    if (end > sizes[fi])
      return bad(i, "byte range [" + std::to_string(o.file_offset) + ", " + std::to_string(end) +
                        ") past end of file (" + std::to_string(sizes[fi]) + " bytes)");
  }

  // 2. Cut the ops into tasks of about task_bytes.
  Runner run(files, fdset.fds, ops, opt);
  Fault fault;
  parse_fault(fault);
  run.fault = &fault;
  const int64_t tb = std::max<int64_t>(opt.task_bytes, 4096);
  for (int64_t i = 0; i < n; ++i) {
    const ReadOp& o = ops[i];
    if (o.rows == 0 || o.row_bytes == 0) continue;
    if (o.rows == 1) {
      const int64_t step = tb - tb % 4;  // whole elements
      for (int64_t b = 0; b < o.row_bytes; b += step)
        run.tasks.push_back({i, 0, 1, b, std::min(step, o.row_bytes - b)});
    } else {
      const int64_t per = std::max<int64_t>(1, tb / std::max<int64_t>(o.src_stride, 1));
      for (int64_t r = 0; r < o.rows; r += per)
        run.tasks.push_back({i, r, std::min(per, o.rows - r), 0, o.row_bytes});
    }
  }
  if (run.tasks.empty()) return res;

  // 3. Run them on a pool; the calling thread works too.
  res.wrote = true;
  const int nthreads =
      int(std::max<int64_t>(1, std::min<int64_t>(opt.threads, int64_t(run.tasks.size()))));
  {
    Joiner join;
    try {
      for (int t = 1; t < nthreads; ++t) join.threads.emplace_back([&run] { run.worker(); });
    } catch (const std::exception&) {
      // Fewer threads than asked: the ones started plus this one still finish the work.
    }
    run.worker();
  }
  res.bytes_read = run.bytes_read.load();
  if (run.failed.load()) {
    res.ok = false;
    res.error = run.error;
    res.failed_op = run.failed_op;
  }
  return res;
}

}  // namespace io
}  // namespace metamat
