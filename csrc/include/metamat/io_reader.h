// Torch-free checkpoint reader: executes a plan of read ops with a pool of pread threads,
// straight into host destination memory, optionally converting fp32 <-> fp16/bf16 on the way.
//
// The Python layer (metamat/fill_load.py) plans the ops, keeps every destination alive for the
// duration of the call, and validates the plan; execute_reads() re-validates what it can see
// (files, byte ranges, dtypes) before the first byte is written, so a bad plan writes nothing.
//
// Destinations are host memory only. CUDA destinations are filled by the staging pipeline
// (stage.h): it re-targets each chunk's ops at a pinned ring buffer, runs execute_reads on
// them, and copies the buffer to the device on its own stream ordered after the caller's.
// ReadOp keeps a plain destination address so a stage can re-target it.
#pragma once
#include <cstddef>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "metamat/dtype.h"
#include "metamat/io_file.h"

namespace metamat {
namespace io {

// Element types: metamat::DType (dtype.h). kRaw copies bytes with no conversion (any dtype);
// the reader converts between kFloat32, kFloat16 and kBFloat16.
using metamat::DType;
using metamat::dtype_size;

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

// How data files are read. kBuffered: pread through the page cache (reads of 1 MiB or more
// ask for sequential readahead: posix_fadvise SEQUENTIAL; METAMAT_IO_READAHEAD=0: no hint).
// kDirect: O_DIRECT into aligned bounce buffers (or straight into the destination where it
// and the range line up), pipelined: a helper thread per reader thread reads the next window
// while the previous one is copied out (io_ahead.h; METAMAT_IO_OVERLAP=0: serial), falling
// back to buffered reads per file where the file system refuses O_DIRECT (EINVAL on open or
// read: some FUSE, file systems that report no direct-I/O support). kAuto: reads of at least
// ReadOptions::auto_direct_min bytes whose pages are mostly not in the page cache (mincore)
// are "cold": read buffered with sequential readahead, then their whole pages are dropped
// from the page cache (POSIX_FADV_DONTNEED), so the cache is left as it was, as with O_DIRECT;
// other reads are plain buffered. A file is judged once per call, by its first large read
// (mincore cannot judge the later ones: the readahead of the earlier ones fills them). Why
// not direct: measured cold on this project's VM (virtio disk; bench/bench_cold.py, same
// runs), buffered + readahead read 1.1-1.5x faster than pipelined O_DIRECT at 1-8 threads
// per rank, and past the raw O_DIRECT whole-file ceiling. METAMAT_IO_AUTO=direct makes kAuto
// read cold ranges with O_DIRECT instead (storage where direct wins). Destinations are
// prefaulted (MADV_POPULATE_WRITE, fill_cpu_prefault.h; METAMAT_PREFAULT=0: off) before they
// are written.
enum class IoMode : int { kBuffered = 0, kDirect = 1, kAuto = 2 };

constexpr int64_t kCoalesceAuto = INT64_MIN;

struct ReadOptions {
  int threads = 4;
  // Work is cut into tasks of about this many bytes so threads balance.
  int64_t task_bytes = int64_t(8) << 20;
  // Per-thread bounce buffer (conversions and coalesced strided reads).
  int64_t bounce_bytes = int64_t(8) << 20;
  // Strided rows whose gap (src_stride - row_bytes) is at most this are read as one span into
  // the bounce buffer and scattered (one syscall instead of one per row). < 0: never.
  // kCoalesceAuto: per op, from the measured crossover (bench/bench_coalesce.py, warm cache:
  // a pread costs about as much as copying 4-8 KiB more through the page cache, and the span's
  // rows must then be copied out of the bounce buffer): coalesce while
  // gap <= 4096 - row_bytes / 16 for buffered reads; direct reads pay a whole device request
  // per row, so they coalesce gaps up to 1 MiB (io=auto: the rule of the path the rows take).
  int64_t coalesce_gap = kCoalesceAuto;
  // Per file (empty: none checked): the identity recorded when the checkpoint was opened.
  // A file whose fstat differs in a checked field (e.g. rewritten with the same size but
  // another layout: new mtime or inode) is refused before anything is written.
  std::vector<FileIdentity> identities;
  // At most this many data-file descriptors open at once (files are opened lazily, least
  // recently used closed first). <= 0: max(16, RLIMIT_NOFILE soft limit / 4).
  int64_t max_open_files = 0;
  IoMode io = IoMode::kBuffered;
  // kAuto: reads shorter than this are never "cold" (plain buffered reads: small reads are
  // cheaper from the page cache, and dropping them would only cost syscalls).
  int64_t auto_direct_min = int64_t(1) << 20;
};

// Whether two option sets read the same way (a kept ReadCrew is reused only for equal ones).
bool same_options(const ReadOptions& a, const ReadOptions& b);

// A checksum block (verified reads): `length` bytes of file `file_index` from `offset`, whose
// XXH3-64 (seed 0) must be `digest` (the manifest's per-4-MiB-block digests). 4 x int64 so
// Python passes an (n, 4) int64 array (the digest's 64 bits as int64).
struct VerifyBlock {
  int64_t file_index;
  int64_t offset;
  int64_t length;
  uint64_t digest;
};
static_assert(sizeof(VerifyBlock) == 4 * sizeof(int64_t), "VerifyBlock must be 4 packed int64");

// How each data file was read (ReadResult::files, one per file of the call).
struct FileReport {
  int64_t bytes_buffered = 0;
  int64_t bytes_direct = 0;     // aligned bytes: ranges are rounded out to the alignment
  bool direct_refused = false;  // O_DIRECT asked for and refused: read buffered instead
  std::string refuse_reason;
};

struct ReadResult {
  bool ok = true;
  std::string error;      // names the file and op index
  int64_t failed_op = -1; // index of the failing op, -1 if none / not op-specific
  int64_t bytes_read = 0; // bytes actually read from files (gaps of coalesced reads included)
  bool wrote = false;     // false: failed during validation, no destination byte touched
  int64_t tasks = 0;      // pieces of work the threads took (verified reads: blocks)
  int64_t threads = 0;    // reader threads of the call (the calling thread included)
  std::vector<FileReport> files;  // per file (empty when validation failed)
  // Verified reads only.
  int64_t bytes_hashed = 0;  // bytes hashed (every byte of every block)
  int64_t bytes_reread = 0;  // bytes read only to complete a block's hash (no op needed them)
  bool mismatch = false;     // a block's digest differed (error says which; fields below)
  int64_t mismatch_file = -1, mismatch_offset = -1, mismatch_length = -1;
  uint64_t mismatch_expected = 0, mismatch_got = 0;
};

// Execute `n` ops. Never throws; joins every thread it starts on every path.
//
// Fault injection (tests only): METAMAT_IO_FAULT="<k>:<mode>" makes the k-th pread of each
// call misbehave: `eio` fails with EIO, `eof` returns 0 (file shrank), `short` returns half
// the bytes asked (must be retried transparently), `eintr` fails with EINTR (retried). The
// variable is read once per call; unset or malformed, it does nothing.
//
// Verified reads (nblocks >= 0): `blocks` must cover every byte of every op's span (first row
// start to last row end), must not overlap, and must not cut a converting op's element. Each
// block is one task: one thread reads its bytes in file order and hashes them as they arrive
// (contiguous raw ops in place in the destination: the bytes hashed are the bytes the model
// receives; converted/strided ops and block bytes no op needs in the bounce buffer), so every
// byte is read once. The first mismatch fails the call (ReadResult::mismatch*) and the other
// threads stop before their next piece.
ReadResult execute_reads(const std::vector<std::string>& files, const ReadOp* ops, int64_t n,
                         const ReadOptions& opt, const VerifyBlock* blocks = nullptr,
                         int64_t nblocks = -1);

// A reader whose threads (each with its bounce buffer, read-ahead helper and held file) and
// whose file table (opened, validated files; io=auto's per-file judgement) live across calls:
// a staging pipeline reads every chunk of a load with one crew instead of starting threads
// and opening files per chunk. run() is execute_reads on the crew's files and options (each
// call validates its ops, reads METAMAT_IO_FAULT and reports its own bytes). What it keeps
// across calls: each file is opened and its identity checked once, when first used (a file
// rewritten in place later is caught only if its descriptor is reopened), O_DIRECT refusals
// and io=auto's per-file judgement. One caller at a time; run() never throws (out of memory
// is a failed result); the destructor joins every thread. A helper thread whose bounce buffer cannot be allocated sits calls out (and tries
// again at the next); the calling thread's own failure fails the call.
class ReadCrew {
 public:
  ReadCrew(const std::vector<std::string>& files, const ReadOptions& opt);
  ~ReadCrew();
  ReadCrew(const ReadCrew&) = delete;
  ReadCrew& operator=(const ReadCrew&) = delete;
  ReadResult run(const ReadOp* ops, int64_t n, const VerifyBlock* blocks = nullptr,
                 int64_t nblocks = -1) noexcept;
  // The files and options it was made for (a caller keeping a crew checks they still apply).
  const std::vector<std::string>& files() const { return files_; }
  const ReadOptions& options() const;

 private:
  ReadResult run_impl(const ReadOp* ops, int64_t n, const VerifyBlock* blocks, int64_t nblocks,
                      bool* published);
  struct Impl;
  std::vector<std::string> files_;
  std::unique_ptr<Impl> impl_;
};

// Reader threads started in this process so far (tests: a crew starts its threads once).
int64_t reader_threads_started();

// Convert `count` elements (src and dst may be unaligned). kRaw on both sides is invalid here.
void convert(const void* src, DType s, void* dst, DType d, int64_t count);

}  // namespace io
}  // namespace metamat
