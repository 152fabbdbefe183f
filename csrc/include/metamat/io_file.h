// Opening checkpoint data files safely: regular files only, never blocking on open (a FIFO or
// a device named as a data file must fail with a clear error, not hang), close-on-exec, and
// the file's identity (device, inode, size, mtime) checked against what the caller recorded.
#pragma once
#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace metamat {
namespace io {

// A data file as it was when the checkpoint was opened. -1 in a field: not checked.
struct FileIdentity {
  int64_t dev = -1;
  int64_t ino = -1;
  int64_t size = -1;
  int64_t mtime_ns = -1;
};

// The identity fstat reports for an open file.
FileIdentity identity_of(const struct stat& st);

// "" when `seen` matches every checked (non -1) field of `want`, else a message naming the
// fields that differ ("file changed since the checkpoint was opened: size 10 -> 12, ...").
std::string identity_mismatch(const FileIdentity& want, const FileIdentity& seen);

// open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | extra_flags), fstat, require a regular file,
// then clear O_NONBLOCK. Returns the fd (>= 0) and fills `st`, or -1 with `err` set (errno in
// `*err_no` when not null: the caller tells EINVAL from O_DIRECT apart from other failures).
// Never blocks: O_NONBLOCK makes opening a FIFO with no writer return at once.
int open_regular(const std::string& path, int extra_flags, struct stat* st, std::string* err,
                 int* err_no = nullptr);

// ---- the files of one read call ----------------------------------------------------------
struct Fault;

// Shared by every thread of one call: the data files, what validation saw, and a bounded cache
// of open descriptors, so a shard set of thousands of files never needs more than `max_open`
// descriptors at once (a batch opening every file up front fails under `ulimit -n 1024`).
//
// Validation opens each file once (regular file, caller identity, size); a file reopened later
// (evicted from the cache, or its O_DIRECT descriptor) must still have the identity validation
// saw, else "file changed since the checkpoint was opened". Thread-safe.
class FileTable {
 public:
  // max_open <= 0: max(16, RLIMIT_NOFILE soft limit / 4). `want` may be empty (unchecked).
  FileTable(const std::vector<std::string>& paths, const std::vector<FileIdentity>& want,
            int64_t max_open, Fault* fault);
  ~FileTable();
  FileTable(const FileTable&) = delete;
  FileTable& operator=(const FileTable&) = delete;

  int64_t count() const { return int64_t(files_.size()); }
  const std::string& path(int64_t fi) const { return files_[size_t(fi)].path; }
  int64_t max_open() const { return max_open_; }
  int64_t open_now() const;  // descriptors open right now (tests, stats)

  // Opens file fi if validation has not seen it yet: regular file, caller identity, size.
  // Returns "" or the error (the file is then unusable).
  std::string validate(int64_t fi);
  bool validated(int64_t fi) const { return files_[size_t(fi)].validated; }
  int64_t size(int64_t fi) const { return files_[size_t(fi)].seen.size; }

  // Direct I/O facts about file fi (after validate): the alignment direct reads need (offsets,
  // lengths and memory), 0 when the file system said it does not support direct I/O.
  int64_t direct_align(int64_t fi) const { return files_[size_t(fi)].align; }
  // Direct reads of file fi were refused (open or read answered EINVAL): later reads of it are
  // buffered. The first reason is kept for the report.
  void refuse_direct(int64_t fi, const std::string& why);
  bool direct_refused(int64_t fi) const { return files_[size_t(fi)].refused.load(); }
  std::string refuse_reason(int64_t fi) const;

  // io=auto: whether file fi is read as cold (1) or cached (2) by this table's reads (a call,
  // or every call of a ReadCrew, which keeps its table), 0 until its first
  // large read decides (decide_auto: the first decision stored wins, and is returned).
  int auto_state(int64_t fi) const { return files_[size_t(fi)].auto_state.load(); }
  int decide_auto(int64_t fi, int state) {
    int none = 0;
    files_[size_t(fi)].auto_state.compare_exchange_strong(none, state);
    return files_[size_t(fi)].auto_state.load();
  }

  // Bytes read from file fi by each path (the per-file mode report).
  void count_bytes(int64_t fi, bool direct, int64_t n) {
    (direct ? files_[size_t(fi)].bytes_direct : files_[size_t(fi)].bytes_buffered) += n;
  }
  int64_t bytes_direct(int64_t fi) const { return files_[size_t(fi)].bytes_direct.load(); }
  int64_t bytes_buffered(int64_t fi) const { return files_[size_t(fi)].bytes_buffered.load(); }

  // A pinned entry: descriptors of file fi stay open (not evicted) while it is held.
  class Lease {
   public:
    Lease() = default;
    ~Lease() { reset(); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    // Pins file fi (releasing any other); "" or an error (file changed, cannot open, ...).
    std::string hold(FileTable* t, int64_t fi);
    void reset();
    int64_t file() const { return fi_; }
    // The buffered (direct=false) or O_DIRECT descriptor, opened on first use. -1 and `err`
    // set on failure; for direct, `*refused` is set when the open answered EINVAL (the caller
    // falls back to buffered reads).
    int fd(bool direct, std::string* err, bool* refused = nullptr);

   private:
    FileTable* t_ = nullptr;
    int64_t fi_ = -1;
  };

 private:
  struct Entry {
    std::string path;
    FileIdentity want;
    FileIdentity seen;  // what validation observed
    bool validated = false;
    int64_t align = 4096;
    std::atomic<bool> refused{false};
    std::atomic<int> auto_state{0};
    std::string refuse_why;
    std::atomic<int64_t> bytes_direct{0}, bytes_buffered{0};
    int fd[2] = {-1, -1};  // buffered, direct
    int64_t refs = 0;
    uint64_t last_use = 0;
  };
  int open_fd(Entry& e, bool direct, std::string* err, bool* refused);  // mu_ held
  void make_room();                                                      // mu_ held

  std::vector<Entry> files_;
  int64_t max_open_;
  int64_t open_ = 0;
  uint64_t clock_ = 0;
  Fault* fault_;
  mutable std::mutex mu_;
};

}  // namespace io
}  // namespace metamat
