// Torch-free staging pipeline (issue 12): checkpoint bytes for device destinations go
// file -> ring of host staging buffers -> CopySink -> destination.
//
// A StagePipeline owns `ring` host buffers of `buffer_bytes` each (page-locked with
// cudaHostAlloc when a sink is CUDA, so cudaMemcpyAsync is truly asynchronous) and one CopySink
// per destination device. run() cuts the ops so none writes more than a buffer, groups them into
// chunks of at most a buffer (64-byte aligned pieces), and for chunk k on buffer b = k % ring:
//   1. waits until every copy issued from b earlier has left it (sink->wait(b): an event),
//   2. reads the chunk into b with the ordinary reader (a ReadCrew, io_reader.h: one crew of
//      threads kept across run() calls until close(), direct or buffered I/O, XXH3 block verification, fp32 <->
//      fp16/bf16 conversion in its host copy loop), which returns when the chunk is read,
//   3. hands each op's staged bytes to its sink (async copy) and records b's event.
// Copies of chunk k run (on a CUDA stream, or the host sink's thread) while chunk k+1 is read
// into the next buffer. Sinks order their copies after the caller's stream when created and
// make the caller's stream wait for them in finish(). close() (also the destructor, on every
// path) drains every sink, calls finish(), joins sink threads and frees the buffers.
//
// Sinks: CUDA (stage_cuda.cu, CUDA build only: its own non-blocking stream per device,
// cudaMemcpyAsync / cudaMemcpy2DAsync, an event per buffer, a device guard around every call)
// and the host "fake copy" sink (memcpy on a separate thread, sequence-number events, same
// ordering and reuse rules), which destinations in host memory use and the CPU tests drive.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "metamat/io_reader.h"
#include "metamat/stage_pool.h"

namespace metamat {
namespace io {

// One copy out of a staging buffer: `rows` rows of `row_bytes` bytes, contiguous at `src`
// (host staging memory), row r to `dst + r*dst_stride`. With `convert` (a DType: float16 or
// bfloat16) the staged rows are float32 and the sink converts them after the copy (CUDA: into
// a device scratch area at `offset`, the item's offset in its staging buffer, then a kernel
// writes the destination), METAMAT_CONVERT_ON=device.
struct CopyItem {
  const unsigned char* src;
  uintptr_t dst;
  int64_t row_bytes;
  int64_t rows;
  int64_t dst_stride;
  int32_t convert = 0;
  int64_t offset = 0;
};

// Where fp32 -> fp16/bf16 conversions of staged loads run: in the reader's host copy loop
// (kHost: half the bytes cross PCIe) or on the destination's side after the copy (kDevice: the
// readers copy raw bytes). METAMAT_CONVERT_ON=host|device|auto, read at every run(); auto is
// host until GPU measurements say otherwise (docs/PERFORMANCE.md).
enum class ConvertOn : int { kHost = 0, kDevice = 1 };
ConvertOn convert_on_from_env();

// Counters of one sink (tests and reports).
struct SinkStats {
  int64_t copies = 0;          // copy() calls
  int64_t bytes = 0;           // bytes copied
  int64_t records = 0;         // record() calls
  int64_t waits = 0;           // wait() calls that had a recorded event to wait for
  int64_t reuse_violations = 0;  // host sink: a buffer handed to the reader with copies pending
  int64_t max_pending = 0;     // host sink: most copies queued at once
  bool began = false;          // ordered after the caller's stream
  bool finished = false;       // the caller's stream ordered after the copies
};

// Where the staged bytes go. One per destination device; called from one thread at a time
// (the pipeline's). Errors throw (CoreError); drain() and the destructor never throw.
class CopySink {
 public:
  virtual ~CopySink() = default;
  // Queue a copy out of staging buffer `buffer`. Returns before the copy is done.
  virtual void copy(const CopyItem& item, int buffer) = 0;
  // Mark: wait(buffer) waits for every copy queued from `buffer` so far.
  virtual void record(int buffer) = 0;
  // Block until the copies marked by buffer's last record() are done (no-op if none).
  virtual void wait(int buffer) = 0;
  // The pipeline is about to write `buffer` (after wait(buffer)); the host sink checks that no
  // copy out of it is still pending.
  virtual void filling(int buffer) { (void)buffer; }
  // Every queued copy is done, then the caller's stream is ordered after them.
  virtual void finish() = 0;
  // Block until every queued copy is done (error paths). Never throws.
  virtual void drain() noexcept = 0;
  virtual SinkStats stats() const = 0;
};

struct SinkSpec {
  enum Kind : int { kHost = 0, kCuda = 1 } kind = kHost;
  int device = -1;           // CUDA: destination device index
  uintptr_t stream = 0;      // CUDA: the caller's cudaStream_t (0: legacy default stream)
  int64_t delay_us = 0;      // host: sleep this long before each copy (tests: slow copies)
  int64_t fail_copy_at = -1; // host: the n-th copy() call (0-based) throws (tests)
  int64_t buffer_bytes = 0;  // set by the pipeline: bytes of each staging buffer
};

std::unique_ptr<CopySink> make_host_sink(const SinkSpec& spec, int ring);
// stage_cuda.cu (stage_cuda_stub.cpp throws: built without CUDA).
std::unique_ptr<CopySink> make_cuda_sink(const SinkSpec& spec, int ring);
// Page-locked host memory (cudaHostAlloc / cudaFreeHost), allocated with `device` current (so
// no context is created on another device); the stub throws / does nothing.
void* pinned_alloc(int64_t bytes, int device);
void pinned_free(void* p) noexcept;
// The host address of page-locked host memory that a device reaches at `ptr` (memory a
// library mapped with cudaHostRegister / cudaHostAlloc), 0 when `ptr` is not such memory;
// never throws. The stub answers 0.
uintptr_t host_pointer(uintptr_t ptr) noexcept;

// Live staging buffers and sink threads in the process (tests: nothing leaks).
int64_t stage_live_buffers();
int64_t stage_live_threads();
void stage_thread_started();
void stage_thread_ended();

// What one run() did, beyond the reader's ReadResult.
struct StageReport {
  int64_t chunks = 0;  // reader calls (one per chunk)
  int64_t pieces = 0;  // ops after cutting to the buffer size
  // Where run()'s time went (seconds, this thread): waiting for a buffer's earlier copies to
  // leave it, reading chunks into buffers (the reader crew), handing copies to the sinks.
  double wait_seconds = 0, read_seconds = 0, queue_seconds = 0;
};

class StagePipeline {
 public:
  // Throws CoreError (bad arguments, allocation or CUDA failure); nothing leaks.
  StagePipeline(int ring, int64_t buffer_bytes, const std::vector<SinkSpec>& sinks);
  ~StagePipeline();
  StagePipeline(const StagePipeline&) = delete;
  StagePipeline& operator=(const StagePipeline&) = delete;

  // Stage `n` ops; `sink_of[i]` is op i's sink. Op destinations (`dst`, `dst_stride`) are
  // where the sink writes (device addresses for CUDA sinks). Verified reads: `blocks` as for
  // execute_reads (covering every op's span); each chunk is verified against the blocks its
  // ops touch. A reader failure returns its ReadResult (failed_op indexes `ops`): destinations
  // of earlier chunks may be written, their copies still queued (close() drains them).
  // Sink failures throw. After close(), throws.
  ReadResult run(const std::vector<std::string>& files, const ReadOp* ops,
                 const int64_t* sink_of, int64_t n, const ReadOptions& opt,
                 const VerifyBlock* blocks, int64_t nblocks, StageReport* report);

  // Drain every sink, finish() each (the caller's streams wait for the copies), free the
  // buffers and join the sink threads. Idempotent; throws the first sink error after
  // releasing everything.
  void close();
  bool closed() const { return closed_; }
  std::vector<SinkStats> stats() const;
  int ring() const { return int(buffers_.size()); }
  int64_t buffer_bytes() const { return bytes_; }
  bool pinned() const { return pinned_; }

 private:
  // A ring buffer, given back to the staging-buffer cache (stage_pool.h) when destroyed.
  struct Buffer {
    StageMemory m;
    int64_t ring_id = 0;
    Buffer() = default;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    Buffer(Buffer&& o) noexcept : m(o.m), ring_id(o.ring_id) { o.m.p = nullptr; }
    ~Buffer();
  };
  void release() noexcept;

  int64_t bytes_ = 0;
  bool pinned_ = false;
  bool closed_ = false;
  int64_t next_ = 0;  // chunks staged so far: the next chunk's buffer is next_ % ring
  mutable std::mutex mu_;
  // Declared before sinks_: members are destroyed in reverse, so sinks (drained in their
  // destructors) go before the memory their copies read.
  std::vector<Buffer> buffers_;
  std::vector<std::unique_ptr<CopySink>> sinks_;
  std::unique_ptr<ReadCrew> crew_;  // the reader threads, kept across run() calls
  std::vector<SinkStats> final_stats_;
};

// Cut `o` so no piece writes more than `max_dst_bytes` (by rows, else inside a row at element
// boundaries), as metamat/load/ops.py split_ops.
void split_op(const ReadOp& o, int64_t max_dst_bytes, std::vector<ReadOp>* out);
int64_t dst_row_bytes(const ReadOp& o);

}  // namespace io
}  // namespace metamat
