// The staging pipeline (stage.h): chunking, ring reuse, buffers; the host copy sink is
// host_sink.cpp, the CUDA one stage_cuda.cu.
#include "metamat/stage.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>

#include "metamat/check.h"
#include "convert_elem.h"
#include "metamat/dtype.h"

namespace metamat {
namespace io {

namespace {

std::atomic<int64_t> g_live_buffers{0};
std::atomic<int64_t> g_live_threads{0};

constexpr int64_t kAlign = 64;  // each op's staging starts 64-byte aligned

}  // namespace

int64_t stage_live_buffers() { return g_live_buffers.load(); }
int64_t stage_live_threads() { return g_live_threads.load(); }
void stage_thread_started() { g_live_threads.fetch_add(1); }
void stage_thread_ended() { g_live_threads.fetch_sub(1); }

ConvertOn convert_on_from_env() {
  const char* e = std::getenv("METAMAT_CONVERT_ON");
  if (e == nullptr || *e == '\0' || std::strcmp(e, "host") == 0 || std::strcmp(e, "auto") == 0)
    return ConvertOn::kHost;
  if (std::strcmp(e, "device") == 0) return ConvertOn::kDevice;
  fail(__FILE__, __LINE__,
       std::string("METAMAT_CONVERT_ON must be host, device or auto, got '") + e + "'");
}

int64_t dst_row_bytes(const ReadOp& o) {
  const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
  if (s == d || dtype_size(s) == 0 || dtype_size(d) == 0) return o.row_bytes;
  return o.row_bytes / dtype_size(s) * dtype_size(d);
}

void split_op(const ReadOp& o, int64_t max_dst_bytes, std::vector<ReadOp>* out) {
  MM_CHECK(max_dst_bytes > 0, "split_op: buffer size must be positive");
  const int64_t row = dst_row_bytes(o);
  if (row * o.rows <= max_dst_bytes) {
    out->push_back(o);
    return;
  }
  auto rows_of = [&](int64_t per, auto&& emit) {
    for (int64_t r0 = 0; r0 < o.rows; r0 += per) {
      ReadOp p = o;
      p.file_offset = o.file_offset + r0 * o.src_stride;
      p.rows = std::min(per, o.rows - r0);
      p.dst = o.dst + r0 * o.dst_stride;
      emit(p);
    }
  };
  if (row <= max_dst_bytes) {
    rows_of(max_dst_bytes / row, [&](const ReadOp& p) { out->push_back(p); });
    return;
  }
  // One row at a time, each cut at element boundaries so its converted bytes fit.
  const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
  const bool conv = s != d && dtype_size(s) > 0 && dtype_size(d) > 0;
  const int64_t si = conv ? dtype_size(s) : 1, di = conv ? dtype_size(d) : 1;
  rows_of(1, [&](const ReadOp& r) {
    const int64_t elems = r.row_bytes / si;
    const int64_t per = std::max<int64_t>(1, max_dst_bytes / di);
    for (int64_t e0 = 0; e0 < elems; e0 += per) {
      const int64_t k = std::min(per, elems - e0);
      ReadOp p = r;
      p.file_offset = r.file_offset + e0 * si;
      p.row_bytes = k * si;
      p.rows = 1;
      p.src_stride = k * si;
      p.dst = r.dst + e0 * di;
      p.dst_stride = k * di;
      out->push_back(p);
    }
  });
}

// ---- the pipeline ---------------------------------------------------------------------------

StagePipeline::Buffer::~Buffer() {
  if (m.p == nullptr) return;
  stage_give_back(m, ring_id);
  g_live_buffers.fetch_sub(1);
}

StagePipeline::StagePipeline(int ring, int64_t buffer_bytes, const std::vector<SinkSpec>& sinks)
    : bytes_(buffer_bytes) {
  MM_CHECK(ring >= 1, "staging ring needs at least one buffer");
  MM_CHECK(buffer_bytes >= kAlign, "staging buffers must hold at least 64 bytes");
  MM_CHECK(!sinks.empty(), "staging pipeline needs at least one sink");
  int pin_device = -1;  // the first CUDA sink's device
  for (const SinkSpec& s : sinks) {
    MM_CHECK(s.kind != SinkSpec::kCuda || s.device >= 0, "CUDA sink needs a device index");
    if (s.kind == SinkSpec::kCuda && !pinned_) {
      pinned_ = true;
      pin_device = s.device;
    }
  }
  const int64_t ring_id = stage_new_ring_id();
  buffers_.reserve(size_t(ring));
  for (int k = 0; k < ring; ++k) {
    Buffer b;
    b.m = stage_take(buffer_bytes, pinned_, pin_device);  // throws on failure
    b.ring_id = ring_id;
    g_live_buffers.fetch_add(1);
    buffers_.push_back(std::move(b));
  }
  // A throw from here unwinds sinks_ (drained, threads joined) then buffers_ (freed).
  for (SinkSpec s : sinks) {
    s.buffer_bytes = buffer_bytes;
    sinks_.push_back(s.kind == SinkSpec::kCuda ? make_cuda_sink(s, ring) : make_host_sink(s, ring));
  }
}

StagePipeline::~StagePipeline() { release(); }

void StagePipeline::release() noexcept {
  crew_.reset();  // joins the reader threads (idle between run() calls)
  for (auto& s : sinks_) s->drain();
  if (final_stats_.empty())
    for (auto& s : sinks_) final_stats_.push_back(s->stats());
  sinks_.clear();
  buffers_.clear();
  closed_ = true;
}

void StagePipeline::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return;
  std::string first;
  for (auto& s : sinks_) {
    try {
      s->finish();
    } catch (const std::exception& e) {
      if (first.empty()) first = e.what();
    }
  }
  release();
  if (!first.empty()) throw CoreError(first);
}

std::vector<SinkStats> StagePipeline::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return final_stats_;
  std::vector<SinkStats> out;
  for (const auto& s : sinks_) out.push_back(s->stats());
  return out;
}

namespace {

// The blocks (sorted by file, offset; non-overlapping) that ops' spans touch, each once.
void select_blocks(const VerifyBlock* blocks, int64_t nblocks, const std::vector<ReadOp>& ops,
                   std::vector<VerifyBlock>* out) {
  std::vector<int64_t> idx;
  for (const ReadOp& o : ops) {
    const int64_t lo = o.file_offset, hi = lo + (o.rows - 1) * o.src_stride + o.row_bytes;
    // first block of the file whose end is past lo
    int64_t a = 0, b = nblocks;
    while (a < b) {
      const int64_t m = (a + b) / 2;
      const VerifyBlock& v = blocks[m];
      if (v.file_index < o.file_index ||
          (v.file_index == o.file_index && v.offset + v.length <= lo))
        a = m + 1;
      else
        b = m;
    }
    for (int64_t k = a; k < nblocks && blocks[k].file_index == o.file_index &&
                        blocks[k].offset < hi; ++k)
      idx.push_back(k);
  }
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  out->clear();
  for (int64_t k : idx) out->push_back(blocks[k]);
}

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

void add_result(ReadResult* acc, const ReadResult& r) {
  acc->bytes_read += r.bytes_read;
  acc->bytes_hashed += r.bytes_hashed;
  acc->bytes_reread += r.bytes_reread;
  acc->wrote = acc->wrote || r.wrote;
  acc->tasks += r.tasks;
  acc->threads = std::max(acc->threads, r.threads);
  if (acc->files.size() < r.files.size()) acc->files.resize(r.files.size());
  for (size_t f = 0; f < r.files.size(); ++f) {
    FileReport& a = acc->files[f];
    a.bytes_buffered += r.files[f].bytes_buffered;
    a.bytes_direct += r.files[f].bytes_direct;
    if (r.files[f].direct_refused && !a.direct_refused) {
      a.direct_refused = true;
      a.refuse_reason = r.files[f].refuse_reason;
    }
  }
}

}  // namespace

ReadResult StagePipeline::run(const std::vector<std::string>& files, const ReadOp* ops,
                              const int64_t* sink_of, int64_t n, const ReadOptions& opt,
                              const VerifyBlock* blocks, int64_t nblocks, StageReport* report) {
  std::lock_guard<std::mutex> lock(mu_);
  MM_CHECK(!closed_, "staging pipeline is closed");
  MM_CHECK(n >= 0 && (n == 0 || (ops != nullptr && sink_of != nullptr)), "bad op array");
  const int64_t nsinks = int64_t(sinks_.size());
  for (int64_t i = 0; i < n; ++i)
    MM_CHECK(sink_of[i] >= 0 && sink_of[i] < nsinks,
             "op " + std::to_string(i) + ": sink index " + std::to_string(sink_of[i]) +
                 " out of range");
  ReadResult acc;
  StageReport rep;

  // Cut every op to fit a buffer; remember which input op each piece came from. Converted
  // on the device side, an op is read raw (fp32 into staging; its rows must fit a buffer).
  const bool on_device = convert_on_from_env() == ConvertOn::kDevice;
  std::vector<ReadOp> pieces;
  std::vector<int64_t> origin;
  std::vector<int32_t> convert;  // per piece: the dtype its sink converts to (0: none)
  for (int64_t i = 0; i < n; ++i) {
    MM_CHECK(ops[i].rows >= 0 && ops[i].row_bytes >= 0, "op " + std::to_string(i) + ": negative size");
    ReadOp o = ops[i];
    int32_t conv = 0;
    if (on_device && DType(o.src_dtype) == DType::kFloat32 &&
        (DType(o.dst_dtype) == DType::kFloat16 || DType(o.dst_dtype) == DType::kBFloat16) &&
        o.row_bytes <= bytes_) {
      conv = int32_t(o.dst_dtype);
      o.dst_dtype = o.src_dtype;
    }
    split_op(o, bytes_, &pieces);
    origin.resize(pieces.size(), i);
    convert.resize(pieces.size(), conv);
  }
  rep.pieces = int64_t(pieces.size());

  const int ring = int(buffers_.size());
  // One crew for every chunk of every run() of this pipeline (a load calls run() once per
  // batch of ops): threads, bounce buffers and open files are set up once per load.
  if (!crew_ || crew_->files() != files || !same_options(crew_->options(), opt))
    crew_.reset(new ReadCrew(files, opt));
  ReadCrew& crew = *crew_;
  std::vector<ReadOp> staged;
  std::vector<CopyItem> items;
  std::vector<int64_t> chunk_ops;  // piece index of each staged op
  std::vector<VerifyBlock> chunk_blocks;
  std::vector<char> used(size_t(nsinks), 0);
  size_t at = 0;
  while (at < pieces.size()) {
    // The next chunk: consecutive pieces whose 64-byte aligned staging fits one buffer.
    const int b = int(next_ % ring);
    unsigned char* buf = buffers_[size_t(b)].m.p;
    staged.clear();
    items.clear();
    chunk_ops.clear();
    int64_t used_bytes = 0;
    while (at < pieces.size()) {
      const ReadOp& p = pieces[at];
      const int64_t row = dst_row_bytes(p), nb = row * p.rows;
      if (!staged.empty() && used_bytes + nb > bytes_) break;
      ReadOp s = p;
      s.dst = int64_t(reinterpret_cast<uintptr_t>(buf + used_bytes));
      s.dst_stride = row;
      staged.push_back(s);
      items.push_back({buf + used_bytes, uintptr_t(p.dst), row, p.rows, p.dst_stride,
                       convert[at], used_bytes});
      chunk_ops.push_back(int64_t(at));
      used_bytes += (nb + kAlign - 1) & ~(kAlign - 1);
      ++at;
    }
    // 1. The buffer's earlier copies have left it.
    auto t0 = Clock::now();
    for (auto& s : sinks_) s->wait(b);
    for (auto& s : sinks_) s->filling(b);
    auto t1 = Clock::now();
    rep.wait_seconds += seconds(t0, t1);
    // 2. Read (and verify, convert) the chunk into it; the crew's threads are done with it
    //    when run() returns.
    const VerifyBlock* vb = nullptr;
    int64_t nvb = -1;
    if (nblocks >= 0) {
      select_blocks(blocks, nblocks, staged, &chunk_blocks);
      vb = chunk_blocks.data();
      nvb = int64_t(chunk_blocks.size());
    }
    ReadResult r = crew.run(staged.data(), int64_t(staged.size()), vb, nvb);
    t0 = Clock::now();
    rep.read_seconds += seconds(t1, t0);
    ++rep.chunks;
    add_result(&acc, r);
    if (!r.ok) {
      acc.ok = false;
      acc.error = r.error;
      acc.failed_op = r.failed_op >= 0 ? origin[size_t(chunk_ops[size_t(r.failed_op)])] : -1;
      acc.mismatch = r.mismatch;
      acc.mismatch_file = r.mismatch_file;
      acc.mismatch_offset = r.mismatch_offset;
      acc.mismatch_length = r.mismatch_length;
      acc.mismatch_expected = r.mismatch_expected;
      acc.mismatch_got = r.mismatch_got;
      ++next_;  // the buffer may hold partial bytes; nothing was queued from it
      if (report != nullptr) *report = rep;
      return acc;
    }
    // 3. Hand the staged bytes to the sinks, then mark the buffer.
    std::fill(used.begin(), used.end(), 0);
    for (size_t k = 0; k < items.size(); ++k) {
      const int64_t s = sink_of[origin[size_t(chunk_ops[k])]];
      if (items[k].rows > 0 && items[k].row_bytes > 0) sinks_[size_t(s)]->copy(items[k], b);
      used[size_t(s)] = 1;
    }
    for (int64_t s = 0; s < nsinks; ++s)
      if (used[size_t(s)]) sinks_[size_t(s)]->record(b);
    rep.queue_seconds += seconds(t0, Clock::now());
    ++next_;
  }
  if (report != nullptr) *report = rep;
  return acc;
}

}  // namespace io
}  // namespace metamat
