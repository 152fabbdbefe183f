// The per-thread read primitive (see io_piece.h): buffered pread into the destination, or into
// a bounce buffer for conversions and coalesced strided rows.
#include "io_piece.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>

#include <algorithm>
#include <cstring>

#include "io_direct.h"
#include "io_prefault.h"

namespace metamat {
namespace io {

namespace {

// Bounce-buffer work is done in pieces that stay in L2, so the scatter/convert pass reads
// from cache rather than memory.
constexpr int64_t kCacheBytes = int64_t(256) << 10;
// Extra bytes around the bounce buffer: direct reads round both ends out to the alignment.
constexpr int64_t kSlack = int64_t(64) << 10;
// Coalescing rule (bench/bench_coalesce.py, warm, here: a pread of a row costs ~0.7 us, about
// what copying 4-8 KiB more through the page cache costs; wide rows also pay their copy out of
// the bounce buffer): buffered reads coalesce while gap <= kCrossoverGap - row_bytes/16; direct
// reads (a device request per row otherwise) up to kDirectCoalesceGap.
constexpr int64_t kCrossoverGap = 4096;
// Buffered preads are issued in requests of at most this: measured on a cold file here
// (ext4 on virtio, read_ahead_kb 8192), 1 MiB requests stream at 3.0-3.6 GB/s where 8 MiB
// ones manage 1.3 GB/s (the kernel's readahead pipelines small sequential reads better);
// warm, the extra syscalls cost ~1 us per MiB.
constexpr int64_t kBufferedRequest = int64_t(1) << 20;
constexpr int64_t kDirectCoalesceGap = int64_t(1) << 20;
// Direct reads are pipelined (io_ahead.h) when the bounce buffer holds two windows of at least
// this; METAMAT_IO_OVERLAP=0 turns the pipeline off (serial read-then-copy).
constexpr int64_t kPipelineMinWindow = int64_t(128) << 10;

// Buffered reads of at least this ask the kernel for sequential readahead (posix_fadvise
// SEQUENTIAL on the descriptor: twice the device's readahead window). Measured cold on this
// project's VM (ext4 on virtio, read_ahead_kb 8192, bench/bench_cold.py, 2 ranks x 2 threads,
// same runs): 0.85-1.15 GB/s with the hint against 0.46-0.78 without it, and above pipelined
// O_DIRECT (0.75-0.91). METAMAT_IO_READAHEAD=0 turns the hint off.
constexpr int64_t kReadaheadMin = int64_t(1) << 20;

bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}
bool overlap_enabled() { return !env_is("METAMAT_IO_OVERLAP", "0"); }

}  // namespace

void OpReader::FreeDeleter::operator()(unsigned char* p) const { ::free(p); }

std::string OpReader::init() {
  // Clamped: a huge request (the option is caller-supplied) must not abort the process.
  int64_t cap = std::min<int64_t>(std::max<int64_t>(s_.opt.bounce_bytes, 64), int64_t(1) << 30);
  cap -= cap % 4;  // whole elements of every dtype
  void* p = nullptr;
  if (::posix_memalign(&p, size_t(kSlack), size_t(cap + 2 * kSlack)) != 0)
    return "cannot allocate the bounce buffer (" + std::to_string(cap) + " bytes)";
  bounce_.reset(static_cast<unsigned char*>(p));
  cap_ = cap;
  readahead_ = !env_is("METAMAT_IO_READAHEAD", "0");
  auto_direct_ = env_is("METAMAT_IO_AUTO", "direct");
  // Direct reads: two slots of half the buffer each (the budget stays what the caller gave),
  // [b, b + half) and [b + half, b + 2 * half) with half <= cap / 2 + kSlack (inside the
  // cap + 2 * kSlack bytes allocated).
  const int64_t half = align_up(cap / 2, kSlack);
  const bool direct =
      s_.opt.io == IoMode::kDirect || (s_.opt.io == IoMode::kAuto && auto_direct_);
  if (direct && half >= kPipelineMinWindow && overlap_enabled()) {
    std::unique_ptr<DirectAhead> ahead(new (std::nothrow) DirectAhead(s_.fault));
    if (ahead && ahead->start(bounce_.get(), bounce_.get() + half, half))
      ahead_ = std::move(ahead);  // else: no helper thread, serial direct reads
  }
  return {};
}

// Bytes per bounce-buffer round trip: buffered reads stay in L2 for the scatter/convert pass;
// direct reads bypass the caches anyway and want large requests.
int64_t OpReader::piece_bytes() const {
  return s_.opt.io == IoMode::kBuffered ? std::min(cap_, kCacheBytes) : cap_;
}

std::string OpReader::hold(int64_t fi) {
  // A window read ahead names the held file's descriptor, which may close once released.
  if (ahead_ && lease_.file() != fi) ahead_->drain();
  return lease_.hold(&s_.files, fi);
}

std::string OpReader::pread_full(int fd, unsigned char* p, int64_t len, int64_t off) {
  while (len > 0) {
    const size_t want = size_t(std::min<int64_t>(len, kBufferedRequest));
    const ssize_t got = s_.fault.pread(fd, p, want, off_t(off), 0);
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

// kAuto: a read of at least auto_direct_min bytes whose pages are mostly not in the page
// cache (mincore).
bool OpReader::cold(int64_t off, int64_t len) {
  if (s_.opt.io != IoMode::kAuto || len < s_.opt.auto_direct_min) return false;
  std::string e;
  const int fd = lease_.fd(false, &e);
  if (fd < 0) return false;  // the buffered path reports the error
  const double in = resident_fraction(fd, off, len);
  return in >= 0 && in < 0.5;
}

// kAuto, buffered: whether this read streams (dropped from the page cache once read). A file
// is judged once per call (per crew: a staged load's chunks share the judgement), by the
// first large read of it (tasks go in file-offset order): its
// later ranges cannot be judged by mincore, the readahead of the earlier ones fills them.
bool OpReader::stream(int64_t fi, int64_t off, int64_t len) {
  if (s_.opt.io != IoMode::kAuto || len < s_.opt.auto_direct_min) return false;
  int st = s_.files.auto_state(fi);
  if (st == 0) st = s_.files.decide_auto(fi, cold(off, len) ? 1 : 2);
  return st == 1;
}

bool OpReader::use_direct(int64_t fi, int64_t off, int64_t len) {
  const IoMode mode = s_.opt.io;
  if (mode == IoMode::kBuffered || (mode == IoMode::kAuto && !auto_direct_) ||
      s_.files.direct_refused(fi))
    return false;
  const int64_t a = s_.files.direct_align(fi);
  if (a <= 0 || a > kSlack) {
    s_.files.refuse_direct(fi, a <= 0 ? "the file system reports no direct I/O (statx)"
                                      : "direct I/O alignment " + std::to_string(a) +
                                            " is larger than the reader supports");
    return false;
  }
  if (mode == IoMode::kDirect) return true;
  return cold(off, len);  // kAuto with METAMAT_IO_AUTO=direct: cold reads direct
}

// An O_DIRECT descriptor of the held file, or -1 (the caller reads buffered: refused, or an
// error the buffered path will meet and report again).
int OpReader::direct_fd(int64_t fi) {
  std::string e;
  bool refused = false;
  const int fd = lease_.fd(true, &e, &refused);
  if (fd < 0 && refused) s_.files.refuse_direct(fi, e);
  return fd;
}

// Aligned cover [a0, a0 + alen) of file bytes into the bounce buffer. Returns "" or an error;
// `*refused` when the read answered EINVAL (the file is then read buffered).
std::string OpReader::direct_cover(int64_t fi, int fd, int64_t a0, int64_t alen, int64_t need,
                                   bool* refused) {
  std::string e;
  const int64_t got = direct_pread(s_.fault, fd, bounce_.get(), alen, a0, need,
                                   s_.files.direct_align(fi), &e, refused);
  if (got < 0) {
    if (*refused) s_.files.refuse_direct(fi, e);
    return e;
  }
  s_.bytes_read += got;
  s_.files.count_bytes(fi, true, got);
  return {};
}

// Direct read of [off, off + len) into dst: the aligned middle straight into dst where dst and
// off have the same residue modulo the alignment, everything else through the bounce buffer
// in windows of up to the buffer's size.
std::string OpReader::direct_to(int64_t fi, int fd, int64_t off, int64_t len,
                                unsigned char* dst, bool* refused) {
  const int64_t a = s_.files.direct_align(fi);
  const int64_t end = off + len;
  const bool lined_up = (int64_t(reinterpret_cast<uintptr_t>(dst)) - off) % a == 0;
  const int64_t mid0 = lined_up ? std::min(end, align_up(off, a)) : end;
  const int64_t mid1 = lined_up ? std::max(mid0, align_down(end, a)) : end;
  const int64_t window = std::max(a, align_down(cap_, a));
  // Through the bounce buffer: [p, q); `last`: nothing of this call follows (the read-ahead
  // may go on with the next piece expect() announced).
  auto via_bounce = [&](int64_t p, int64_t q, bool last) -> std::string {
    if (ahead_) return pipelined_to(fi, fd, off, p, q, dst, last, refused);
    while (p < q) {
      if (s_.cancel.load(std::memory_order_relaxed)) return {};
      const int64_t a0 = align_down(p, a);
      const int64_t a1 = std::min(align_up(q, a), a0 + window);
      const int64_t stop = std::min(q, a1);
      prefault_bytes(dst + (p - off), stop - p);
      std::string e = direct_cover(fi, fd, a0, a1 - a0, stop - a0, refused);
      if (!e.empty()) return e;
      std::memcpy(dst + (p - off), bounce_.get() + (p - a0), size_t(stop - p));
      p = stop;
    }
    return {};
  };
  std::string e = via_bounce(off, mid0, mid0 >= end);
  if (!e.empty() || mid1 <= mid0) return e.empty() ? via_bounce(mid1, end, true) : e;
  // Straight into the destination.
  const int64_t got = direct_pread(s_.fault, fd, dst + (mid0 - off), mid1 - mid0, mid0,
                                   mid1 - mid0, a, &e, refused);
  if (got < 0) {
    if (*refused) s_.files.refuse_direct(fi, e);
    return e;
  }
  s_.bytes_read += got;
  s_.files.count_bytes(fi, true, got);
  return via_bounce(mid1, end, true);
}

// The aligned window that starts the bounce read of [p, q): at most `size` bytes.
DirectAhead::Window OpReader::window(int64_t fi, int fd, int64_t p, int64_t q,
                                     int64_t size) const {
  const int64_t a = s_.files.direct_align(fi);
  DirectAhead::Window w;
  w.fi = fi;
  w.fd = fd;
  w.align = a;
  w.a0 = align_down(p, a);
  const int64_t a1 = std::min(align_up(q, a), w.a0 + std::max(a, align_down(size, a)));
  w.alen = a1 - w.a0;
  w.need = std::min(q, a1) - w.a0;
  return w;
}

void OpReader::expect(const ReadOp* o, int64_t byte0, int64_t bytes) {
  next_op_ = o;
  next_byte0_ = byte0;
  next_bytes_ = bytes;
}

// The first window the announced piece will read through the bounce buffer, if it will be
// read exactly so: a plain (rows == 1, no conversion) op of the file held now, read direct,
// starting in the bounce buffer (direct_to's rule); else none. One shot.
DirectAhead::Window OpReader::next_window() {
  const ReadOp* o = next_op_;
  next_op_ = nullptr;
  if (o == nullptr || o->rows != 1 || o->src_dtype != o->dst_dtype || next_bytes_ <= 0 ||
      o->file_index != lease_.file())
    return {};
  const int64_t fi = o->file_index, off = o->file_offset + next_byte0_;
  const int64_t end = off + next_bytes_;
  if (!use_direct(fi, off, next_bytes_)) return {};
  const int fd = direct_fd(fi);
  if (fd < 0) return {};
  const int64_t a = s_.files.direct_align(fi);
  const int64_t dst = o->dst + next_byte0_;
  const int64_t q = (dst - off) % a == 0 ? std::min(end, align_up(off, a)) : end;
  return q > off ? window(fi, fd, off, q, ahead_->slot_bytes()) : DirectAhead::Window();
}

// via_bounce with read-ahead: window k+1 (or, after the last, the next piece's first) is read
// by the helper while window k is copied out; a window already read ahead is used as it is.
std::string OpReader::pipelined_to(int64_t fi, int fd, int64_t off, int64_t p, int64_t q,
                                   unsigned char* dst, bool last, bool* refused) {
  if (p >= q) return {};
  const int64_t size = ahead_->slot_bytes();
  DirectAhead::Window cur = window(fi, fd, p, q, size);
  int s = ahead_->find(cur);
  if (s < 0) {
    ahead_->drain();  // stale windows (a hint not followed): their bytes are not wanted
    s = 0;
    ahead_->submit(s, cur);
  }
  for (;;) {
    if (s_.cancel.load(std::memory_order_relaxed)) return {};
    const int64_t stop = cur.a0 + cur.need;  // min(q, end of the window)
    const bool more = stop < q;
    const DirectAhead::Window nxt =
        more ? window(fi, fd, stop, q, size) : last ? next_window() : DirectAhead::Window();
    const int o = 1 - s;
    if (nxt.valid() && ahead_->find(nxt) != o) {
      ahead_->release(o);
      ahead_->submit(o, nxt);
    }
    // The destination's page faults in one batch, while the reads are in flight.
    prefault_bytes(dst + (p - off), stop - p);
    const DirectAhead::Result r = ahead_->wait(s);
    if (r.got < 0) {
      *refused = r.einval;
      if (r.einval) s_.files.refuse_direct(fi, r.err);
      ahead_->release(s);
      return r.err;
    }
    s_.bytes_read += r.got;
    s_.files.count_bytes(fi, true, r.got);
    std::memcpy(dst + (p - off), ahead_->slot(s) + (p - cur.a0), size_t(stop - p));
    ahead_->release(s);
    if (!more) return {};
    p = stop;
    cur = nxt;
    s = o;
  }
}

// `stream`: a cold read of io=auto: its whole pages are dropped from the page cache once read
// (posix_fadvise DONTNEED), so a load leaves the cache as it found it, as O_DIRECT would.
std::string OpReader::buffered_to(int64_t fi, int64_t off, int64_t len, unsigned char* dst,
                                  bool stream) {
  std::string e;
  const int fd = lease_.fd(false, &e);
  if (fd < 0) return e;
  prefault_bytes(dst, len);  // fresh destination pages: faulted in one batch
  if (len >= kReadaheadMin && readahead_ && (fd != sequential_fd_ || fi != sequential_fi_)) {
    // Per open file description (shared by the call's threads); a hint: errors ignored.
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    sequential_fd_ = fd;
    sequential_fi_ = fi;
  }
  e = pread_full(fd, dst, len, off);
  if (e.empty()) {
    s_.bytes_read += len;
    s_.files.count_bytes(fi, false, len);
    const int64_t lo = align_up(off, 4096), hi = align_down(off + len, 4096);
    if (stream && hi > lo) ::posix_fadvise(fd, lo, hi - lo, POSIX_FADV_DONTNEED);
  }
  return e;
}

std::string OpReader::read_to(int64_t fi, int64_t off, int64_t len, unsigned char* dst) {
  std::string e = hold(fi);
  if (!e.empty()) return e;
  if (use_direct(fi, off, len)) {
    const int fd = direct_fd(fi);
    if (fd >= 0) {
      bool refused = false;
      e = direct_to(fi, fd, off, len, dst, &refused);
      if (!refused) return e;  // done, or a real error; refused: read it buffered below
    }
  }
  return buffered_to(fi, off, len, dst, stream(fi, off, len));
}

std::string OpReader::read_view(int64_t fi, int64_t off, int64_t len, const unsigned char** out) {
  std::string e = hold(fi);
  if (!e.empty()) return e;
  settle();  // the bounce buffer is this read's: no window read ahead into it
  if (use_direct(fi, off, len)) {
    const int fd = direct_fd(fi);
    if (fd >= 0) {
      const int64_t a = s_.files.direct_align(fi);
      const int64_t a0 = align_down(off, a);
      bool refused = false;
      e = direct_cover(fi, fd, a0, align_up(off + len, a) - a0, off + len - a0, &refused);
      if (!refused) {
        *out = bounce_.get() + (off - a0);
        return e;
      }
    }
  }
  *out = bounce_.get() + kSlack;
  return buffered_to(fi, off, len, bounce_.get() + kSlack, stream(fi, off, len));
}

// Whether the rows of strided op o are read as spans including the gaps (ReadOptions::
// coalesce_gap; see there for the measured rule).
bool OpReader::coalesce_rows(const ReadOp& o, int64_t row0, int64_t rows) {
  const int64_t gap = o.src_stride - o.row_bytes;
  if (s_.opt.coalesce_gap != kCoalesceAuto)
    return s_.opt.coalesce_gap >= 0 && gap <= s_.opt.coalesce_gap;
  bool direct = s_.opt.io == IoMode::kDirect;
  if (s_.opt.io == IoMode::kAuto && auto_direct_ && hold(o.file_index).empty()) {
    // The rows' pages decide: cold ones will be read direct, cached ones buffered.
    const int64_t start = o.file_offset + row0 * o.src_stride;
    direct = use_direct(o.file_index, start, (rows - 1) * o.src_stride + o.row_bytes);
  }
  if (direct) return gap <= kDirectCoalesceGap;
  return gap <= kCrossoverGap - o.row_bytes / 16;
}

// Rows [row0, row0 + rows) of a strided op, through the bounce buffer where they are
// coalesced or converted.
std::string OpReader::read_rows(const ReadOp& o, int64_t row0, int64_t rows) {
  const int64_t cap = piece_bytes();
  const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
  const bool conv = s != d;
  const int64_t ssz = conv ? dtype_size(s) : 1;
  const int64_t dsz = conv ? dtype_size(d) : 1;
  const bool coalesce = rows > 1 && o.src_stride <= cap && coalesce_rows(o, row0, rows);
  auto* dst0 = reinterpret_cast<unsigned char*>(o.dst);
  int64_t r = row0;
  const int64_t end = row0 + rows;
  while (r < end) {
    if (s_.cancel.load(std::memory_order_relaxed)) return {};
    if (coalesce) {
      // k rows in one span: (k-1)*stride + row_bytes bytes.
      const int64_t k = std::min<int64_t>(end - r, (cap - o.row_bytes) / o.src_stride + 1);
      const int64_t span = (k - 1) * o.src_stride + o.row_bytes;
      const unsigned char* src = nullptr;
      std::string e = read_view(o.file_index, o.file_offset + r * o.src_stride, span, &src);
      if (!e.empty()) return e;
      for (int64_t i = 0; i < k; ++i) {
        unsigned char* dst = dst0 + (r + i) * o.dst_stride;
        if (conv) convert(src + i * o.src_stride, s, dst, d, o.row_bytes / ssz);
        else std::memcpy(dst, src + i * o.src_stride, size_t(o.row_bytes));
      }
      r += k;
      continue;
    }
    // One row (in pieces when it is longer than the buffer) at a time.
    unsigned char* dst_row = dst0 + r * o.dst_stride;
    const int64_t src_row = o.file_offset + r * o.src_stride;
    if (!conv) {
      std::string e = read_to(o.file_index, src_row, o.row_bytes, dst_row);
      if (!e.empty()) return e;
    } else {
      const int64_t piece = std::max<int64_t>(ssz, cap / ssz * ssz);
      for (int64_t b = 0; b < o.row_bytes; b += piece) {
        const int64_t len = std::min(piece, o.row_bytes - b);
        const unsigned char* src = nullptr;
        std::string e = read_view(o.file_index, src_row + b, len, &src);
        if (!e.empty()) return e;
        convert(src, s, dst_row + b / ssz * dsz, d, len / ssz);
      }
    }
    ++r;
  }
  return {};
}

// Bytes [byte0, byte0 + bytes) of a single-row op.
std::string OpReader::read_run(const ReadOp& o, int64_t byte0, int64_t bytes) {
  const DType s = DType(o.src_dtype), d = DType(o.dst_dtype);
  auto* dst = reinterpret_cast<unsigned char*>(o.dst);
  if (s == d) return read_to(o.file_index, o.file_offset + byte0, bytes, dst + byte0);
  const int64_t ssz = dtype_size(s), dsz = dtype_size(d);
  const int64_t piece = std::max<int64_t>(ssz, piece_bytes() / ssz * ssz);
  for (int64_t b = byte0; b < byte0 + bytes; b += piece) {
    if (s_.cancel.load(std::memory_order_relaxed)) return {};
    const int64_t len = std::min(piece, byte0 + bytes - b);
    const unsigned char* src = nullptr;
    std::string e = read_view(o.file_index, o.file_offset + b, len, &src);
    if (!e.empty()) return e;
    convert(src, s, dst + b / ssz * dsz, d, len / ssz);
  }
  return {};
}

std::string OpReader::read(const ReadOp& o, int64_t row0, int64_t rows, int64_t byte0,
                           int64_t bytes) {
  if (o.rows == 1) return read_run(o, byte0, bytes);
  return read_rows(o, row0, rows);
}

}  // namespace io
}  // namespace metamat
