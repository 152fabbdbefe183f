// Torch-free checkpoint reader: executes a plan of read ops with a pool of pread threads,
// straight into host destination memory, optionally converting fp32 <-> fp16/bf16 on the way.
//
// The Python layer (metamat/fill_load.py) plans the ops, keeps every destination alive for the
// duration of the call, and validates the plan; execute_reads() re-validates what it can see
// (files, byte ranges, dtypes) before the first byte is written, so a bad plan writes nothing.
//
// CUDA destinations are not handled here yet: they will go through a pinned staging ring
// (read into pinned host buffers, then an H2D copy + convert on the caller's stream); ops keep
// a plain destination address so that stage can re-target them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace metamat {
namespace io {

// Element types the reader understands. kRaw: bytes are copied, no conversion (any dtype).
enum class DType : int64_t { kRaw = 0, kF32 = 1, kF16 = 2, kBF16 = 3 };

// One strided read: `rows` rows of `row_bytes` bytes (source dtype) each; row r starts at
// file byte `file_offset + r*src_stride` and lands at `dst + r*dst_stride`. Destination rows
// hold row_bytes / itemsize(src) * itemsize(dst) bytes. A contiguous read is rows == 1.
// All fields are int64 so Python can build the plan as an (n, 9) int64 array.
struct ReadOp {
  int64_t file_index;
  int64_t file_offset;
  int64_t row_bytes;
  int64_t rows;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t dst;  // host address of row 0
  int64_t src_dtype;  // DType
  int64_t dst_dtype;  // DType
};
static_assert(sizeof(ReadOp) == 9 * sizeof(int64_t), "ReadOp must be 9 packed int64");

struct ReadOptions {
  int threads = 4;
  // Work is cut into tasks of about this many bytes so threads balance.
  int64_t task_bytes = int64_t(8) << 20;
  // Per-thread bounce buffer (conversions and coalesced strided reads).
  int64_t bounce_bytes = int64_t(8) << 20;
  // Strided rows whose gap (src_stride - row_bytes) is at most this are read as one span into
  // the bounce buffer and scattered (one syscall instead of one per row). <0: never.
  int64_t coalesce_gap = 4096;
};

struct ReadResult {
  bool ok = true;
  std::string error;      // names the file and op index
  int64_t failed_op = -1; // index of the failing op, -1 if none / not op-specific
  int64_t bytes_read = 0; // bytes actually read from files (gaps of coalesced reads included)
  bool wrote = false;     // false: failed during validation, no destination byte touched
};

// Execute `n` ops. Never throws; joins every thread it starts on every path.
//
// Fault injection (tests only): METAMAT_IO_FAULT="<k>:<mode>" makes the k-th pread of each
// call misbehave: `eio` fails with EIO, `eof` returns 0 (file shrank), `short` returns half
// the bytes asked (must be retried transparently), `eintr` fails with EINTR (retried). The
// variable is read once per call; unset or malformed, it does nothing.
ReadResult execute_reads(const std::vector<std::string>& files, const ReadOp* ops, int64_t n,
                         const ReadOptions& opt);

// Convert `count` elements (src and dst may be unaligned). kRaw on both sides is invalid here.
void convert(const void* src, DType s, void* dst, DType d, int64_t count);

int64_t dtype_size(DType t);  // 0 for kRaw / unknown

}  // namespace io
}  // namespace metamat
