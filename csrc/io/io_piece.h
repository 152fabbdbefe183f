// The per-thread read primitive of the checkpoint reader: one op (or a piece of one: a row
// range, or a byte range of a single-row op) read from its file into host memory, converting
// dtypes on the way. execute_reads() runs these on a thread pool; a staging pipeline (pinned
// ring -> device) calls the same primitive with ops whose destination is a staging buffer.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "io_ahead.h"
#include "io_fault.h"
#include "metamat/io_file.h"
#include "metamat/io_reader.h"

namespace metamat {
namespace io {

// What the threads of one call share. `files` must have validated every file an op names.
struct ReadShared {
  FileTable& files;
  const ReadOptions& opt;
  Fault& fault;
  std::atomic<bool> cancel{false};       // set on the first failure: others stop early
  std::atomic<int64_t> bytes_read{0};    // bytes read from files (coalesced gaps included)

  ReadShared(FileTable& f, const ReadOptions& o, Fault& fl) : files(f), opt(o), fault(fl) {}
};

// One thread's reader: its bounce buffer and the file it holds open. Not thread-safe (one per
// thread); every method returns "" or an error message (never throws, except bad_alloc from
// std::string).
class OpReader {
 public:
  explicit OpReader(ReadShared& s) : s_(s) {}
  // Allocates the bounce buffer (ReadOptions::bounce_bytes, clamped to [64 B, 1 GiB]).
  std::string init();

  // Rows [row0, row0 + rows) of `o` (rows > 1 ops), or bytes [byte0, byte0 + bytes) of its
  // single row (rows == 1 ops), into o's destination. The op must have passed validation.
  std::string read(const ReadOp& o, int64_t row0, int64_t rows, int64_t byte0, int64_t bytes);

  // Read-ahead (direct reads with a helper thread, see io_ahead.h): the piece this reader will
  // read() next, so the first window of it can be read while this one is copied out. Only a
  // hint: a piece read some other way just leaves the window unused (and uncounted). `o`
  // must stay alive until that read().
  void expect(const ReadOp* o, int64_t byte0, int64_t bytes);
  // Between calls of a crew (io_reader.h ReadCrew): forget the announced piece (it pointed
  // into the call's ops) and let the read-ahead helper finish.
  void idle() {
    next_op_ = nullptr;
    settle();
  }
  // True when direct reads are pipelined through a helper thread (worth calling expect()).
  bool pipelined() const { return ahead_ != nullptr; }

  // File bytes [off, off + len) of file fi, exactly, into `dst`.
  std::string read_to(int64_t fi, int64_t off, int64_t len, unsigned char* dst);
  // File bytes [off, off + len) into the bounce buffer; `*out` points at the first one.
  // len <= view_cap().
  std::string read_view(int64_t fi, int64_t off, int64_t len, const unsigned char** out);
  int64_t view_cap() const { return cap_; }
  // Bytes per bounce round trip: L2-sized for buffered reads, the whole buffer for direct.
  int64_t piece_bytes() const;

 private:
  std::string hold(int64_t fi);
  bool coalesce_rows(const ReadOp& o, int64_t row0, int64_t rows);
  bool use_direct(int64_t fi, int64_t off, int64_t len);
  bool cold(int64_t off, int64_t len);
  bool stream(int64_t fi, int64_t off, int64_t len);
  int direct_fd(int64_t fi);
  std::string direct_cover(int64_t fi, int fd, int64_t a0, int64_t alen, int64_t need,
                           bool* refused);
  std::string direct_to(int64_t fi, int fd, int64_t off, int64_t len, unsigned char* dst,
                        bool* refused);
  DirectAhead::Window window(int64_t fi, int fd, int64_t p, int64_t q, int64_t size) const;
  DirectAhead::Window next_window();
  std::string pipelined_to(int64_t fi, int fd, int64_t off, int64_t p, int64_t q,
                           unsigned char* dst, bool last, bool* refused);
  void settle() {
    if (ahead_) ahead_->drain();
  }
  std::string buffered_to(int64_t fi, int64_t off, int64_t len, unsigned char* dst,
                          bool stream);
  std::string pread_full(int fd, unsigned char* buf, int64_t len, int64_t off);
  std::string read_rows(const ReadOp& o, int64_t row0, int64_t rows);
  std::string read_run(const ReadOp& o, int64_t byte0, int64_t bytes);

  struct FreeDeleter {
    void operator()(unsigned char* p) const;
  };
  ReadShared& s_;
  std::unique_ptr<unsigned char, FreeDeleter> bounce_;
  int64_t cap_ = 0;
  FileTable::Lease lease_;
  bool readahead_ = true;     // METAMAT_IO_READAHEAD != 0
  bool auto_direct_ = false;  // METAMAT_IO_AUTO=direct: io=auto reads cold ranges direct
  int sequential_fd_ = -1;    // the descriptor (of file sequential_fi_) last given the
  int64_t sequential_fi_ = -1;  // SEQUENTIAL readahead hint
  // The piece expect() announced (op null: none).
  const ReadOp* next_op_ = nullptr;
  int64_t next_byte0_ = 0, next_bytes_ = 0;
  // Last: destroyed (helper joined) before the bounce buffer and the descriptors it reads.
  std::unique_ptr<DirectAhead> ahead_;
};

}  // namespace io
}  // namespace metamat
