// Validating a read call's ops and cutting them into tasks: see io_tasks.h.
#include "io_tasks.h"

#include <algorithm>

#include "metamat/dtype.h"

namespace metamat {
namespace io {

std::string op_error(const FileTable& files, const ReadOp* ops, int64_t i,
                     const std::string& msg) {
  const bool has_file =
      i >= 0 && ops[i].file_index >= 0 && ops[i].file_index < files.count();
  return (has_file ? "file " + files.path(ops[i].file_index) + ", " : std::string()) +
         (i >= 0 ? "read op " + std::to_string(i) + ": " : std::string()) + msg;
}

std::string validate_op(FileTable& files, const ReadOp& o) {
  if (o.file_index < 0 || o.file_index >= files.count())
    return "file index " + std::to_string(o.file_index) + " out of range";
  std::string e = files.validate(o.file_index);
  if (!e.empty()) return e;
  if (o.rows < 0 || o.row_bytes < 0 || o.file_offset < 0 || o.src_stride < 0)
    return "negative size, offset or stride";
  const auto known = [](int64_t c) { return c >= 0 && c <= int64_t(DType::kFloat64); };
  if (!known(o.src_dtype) || !known(o.dst_dtype))
    return "unknown dtype code " + std::to_string(o.src_dtype) + " -> " +
           std::to_string(o.dst_dtype);
  const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
  if (s != d && !(is_convertible_float(s) && is_convertible_float(d)))
    return "unsupported conversion " + std::to_string(o.src_dtype) + " -> " +
           std::to_string(o.dst_dtype);
  if (s != d && o.row_bytes % dtype_size(s) != 0)
    return "row bytes not a whole number of source elements";
  if (o.rows == 0 || o.row_bytes == 0) return {};
  if (o.dst == 0) return "null destination";
  if (o.rows > 1 && o.src_stride < o.row_bytes) return "source rows overlap";
  // end = file_offset + (rows-1)*src_stride + row_bytes, overflow-checked.
  int64_t end;
  if (__builtin_mul_overflow(o.rows - 1, o.src_stride, &end) ||
      __builtin_add_overflow(end, o.row_bytes, &end) ||
      __builtin_add_overflow(end, o.file_offset, &end))
    return "byte range overflows int64";
  const int64_t size = files.size(o.file_index);
  if (end > size)
    return "byte range [" + std::to_string(o.file_offset) + ", " + std::to_string(end) +
           ") past end of file (" + std::to_string(size) + " bytes)";
  return {};
}

namespace {

// Smallest task a call with less than task_bytes per thread is cut into: a page-cache pread of
// 2 MiB costs ~300 us, so the per-task overhead (a few us) stays small; a direct read is still
// a large device request, and a task still spans io=auto's 1 MiB threshold for judging a file.
constexpr int64_t kMinSplitTask = int64_t(2) << 20;

// Bytes per task: task_bytes, or less when the call spans fewer than `threads` tasks of it, so
// that every thread gets a share (a staging chunk of 24 MiB read by 8 threads is 8 tasks of
// 3 MiB, not 3 of 8 MiB read by 3 threads while 5 idle). Sizes are file spans, the unit
// make_tasks cuts by (a strided op's rows count with their stride).
int64_t task_size(const ReadOp* ops, int64_t n, const ReadOptions& opt) {
  const int64_t tb = std::max<int64_t>(opt.task_bytes, 4096);
  const int64_t threads = std::max(1, opt.threads);
  int64_t enough;  // tb per thread (caller-supplied sizes: overflow means "plenty")
  if (__builtin_mul_overflow(tb, threads, &enough)) return tb;
  int64_t total = 0;
  for (int64_t i = 0; i < n && total < enough; ++i) {
    const ReadOp& o = ops[i];
    if (o.rows <= 0 || o.row_bytes <= 0) continue;  // no task (make_tasks skips it too)
    int64_t b;
    if (__builtin_mul_overflow(o.rows, o.rows == 1 ? o.row_bytes : o.src_stride, &b) ||
        __builtin_add_overflow(total, b, &total))
      return tb;
  }
  if (total >= enough) return tb;
  const int64_t share = total / threads + (total % threads != 0);
  if (threads == 1 || share > tb - 4096) return tb;  // before rounding up, which could overflow
  return std::min(tb, std::max(kMinSplitTask, (share + 4095) / 4096 * 4096));
}

}  // namespace

std::vector<Task> make_tasks(const ReadOp* ops, int64_t n, const ReadOptions& opt) {
  std::vector<Task> tasks;
  const int64_t tb = task_size(ops, n, opt);
  for (int64_t i = 0; i < n; ++i) {
    const ReadOp& o = ops[i];
    if (o.rows == 0 || o.row_bytes == 0) continue;
    if (o.rows == 1) {
      const int64_t step = tb - tb % 4;  // whole elements
      for (int64_t b = 0; b < o.row_bytes; b += step)
        tasks.push_back({i, 0, 1, b, std::min(step, o.row_bytes - b)});
    } else {
      const int64_t per = std::max<int64_t>(1, tb / std::max<int64_t>(o.src_stride, 1));
      for (int64_t r = 0; r < o.rows; r += per)
        tasks.push_back({i, r, std::min(per, o.rows - r), 0, o.row_bytes});
    }
  }
  auto start = [&](const Task& t) {
    const ReadOp& o = ops[t.op];
    return o.file_offset + t.row0 * o.src_stride + t.byte0;
  };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    const int64_t fa = ops[a.op].file_index, fb = ops[b.op].file_index;
    return fa != fb ? fa < fb : start(a) < start(b);
  });
  return tasks;
}

}  // namespace io
}  // namespace metamat
