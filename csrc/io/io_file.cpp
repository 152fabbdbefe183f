// Regular-file opening and identity checks. See io_file.h.
#include "metamat/io_file.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "io_fault.h"

namespace metamat {
namespace io {

namespace {

const char* kind_of(mode_t m) {
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISDIR(m)) return "a directory";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

}  // namespace

FileIdentity identity_of(const struct stat& st) {
  FileIdentity id;
  id.dev = int64_t(st.st_dev);
  id.ino = int64_t(st.st_ino);
  id.size = int64_t(st.st_size);
  id.mtime_ns = int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec);
  return id;
}

std::string identity_mismatch(const FileIdentity& want, const FileIdentity& seen) {
  std::string diff;
  auto field = [&](const char* name, int64_t w, int64_t s) {
    if (w < 0 || w == s) return;
    diff += (diff.empty() ? "" : ", ") + std::string(name) + " " + std::to_string(w) + " -> " +
            std::to_string(s);
  };
  field("st_dev", want.dev, seen.dev);
  field("st_ino", want.ino, seen.ino);
  field("size", want.size, seen.size);
  field("mtime_ns", want.mtime_ns, seen.mtime_ns);
  return diff.empty() ? diff : "file changed since the checkpoint was opened: " + diff;
}

int open_regular(const std::string& path, int extra_flags, struct stat* st, std::string* err,
                 int* err_no) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | extra_flags);
  if (fd < 0) {
    if (err_no != nullptr) *err_no = errno;
    *err = std::string("cannot open: ") + std::strerror(errno);
    return -1;
  }
  auto give_up = [&](const std::string& msg, int e) {
    ::close(fd);
    if (err_no != nullptr) *err_no = e;
    *err = msg;
    return -1;
  };
  if (::fstat(fd, st) != 0) return give_up(std::string("fstat: ") + std::strerror(errno), errno);
  if (!S_ISREG(st->st_mode))
    return give_up(std::string("not a regular file (") + kind_of(st->st_mode) +
                       "): a checkpoint data file must be a regular file",
                   EINVAL);
  // Reads of a regular file ignore O_NONBLOCK today, but clear it so a future kernel (or a
  // FUSE file system that honours it) never answers EAGAIN mid-read.
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
    return give_up(std::string("fcntl: ") + std::strerror(errno), errno);
  return fd;
}

// ---- FileTable -------------------------------------------------------------------------

namespace {

int64_t default_max_open() {
  struct rlimit rl;
  int64_t soft = 1024;
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    soft = int64_t(rl.rlim_cur);
  else if (::getrlimit(RLIMIT_NOFILE, &rl) == 0)
    soft = int64_t(1) << 20;
  return std::max<int64_t>(16, soft / 4);
}

// The alignment O_DIRECT needs for file `fd` (offsets, lengths and memory): statx
// STATX_DIOALIGN where the kernel and file system report it (0: no direct I/O), else 4096,
// which every Linux file system accepts. Never less than 4096, so reads cover whole pages.
int64_t dio_align(int fd) {
#ifdef STATX_DIOALIGN
  struct statx sx;
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
      (sx.stx_mask & STATX_DIOALIGN) != 0) {
    if (sx.stx_dio_offset_align == 0) return 0;
    return std::max<int64_t>({4096, int64_t(sx.stx_dio_offset_align),
                              int64_t(sx.stx_dio_mem_align)});
  }
#else
  (void)fd;
#endif
  return 4096;
}

}  // namespace

FileTable::FileTable(const std::vector<std::string>& paths,
                     const std::vector<FileIdentity>& want, int64_t max_open, Fault* fault)
    : files_(paths.size()),
      max_open_(max_open > 0 ? std::max<int64_t>(max_open, 2) : default_max_open()),
      fault_(fault) {
  for (size_t i = 0; i < paths.size(); ++i) {
    files_[i].path = paths[i];
    if (i < want.size()) files_[i].want = want[i];
  }
}

FileTable::~FileTable() {
  for (Entry& e : files_)
    for (int& fd : e.fd)
      if (fd >= 0) ::close(fd);
}

int64_t FileTable::open_now() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_;
}

void FileTable::make_room() {
  while (open_ >= max_open_) {
    Entry* lru = nullptr;
    for (Entry& e : files_)
      if (e.refs == 0 && (e.fd[0] >= 0 || e.fd[1] >= 0) &&
          (lru == nullptr || e.last_use < lru->last_use))
        lru = &e;
    if (lru == nullptr) return;  // every open file is in use: go over by at most one per thread
    for (int& fd : lru->fd)
      if (fd >= 0) {
        ::close(fd);
        fd = -1;
        --open_;
      }
  }
}

int FileTable::open_fd(Entry& e, bool direct, std::string* err, bool* refused) {
  make_room();
  struct stat st;
  int err_no = 0;
  int fd = -1;
  if (direct && fault_ != nullptr && fault_->refuse_direct_open()) {
    err_no = EINVAL;
    *err = "cannot open with O_DIRECT: Invalid argument (injected)";
  } else {
    fd = open_regular(e.path, direct ? O_DIRECT : 0, &st, err, &err_no);
  }
  if (fd < 0) {
    if (direct && err_no == EINVAL && refused != nullptr) *refused = true;
    return -1;
  }
  if (e.validated) {
    // A reopen: the file must still be the one validation saw.
    const std::string changed = identity_mismatch(e.seen, identity_of(st));
    if (!changed.empty()) {
      ::close(fd);
      *err = changed;
      return -1;
    }
  }
  ++open_;
  e.fd[direct ? 1 : 0] = fd;
  return fd;
}

std::string FileTable::validate(int64_t fi) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = files_[size_t(fi)];
  if (e.validated) return {};
  make_room();
  struct stat st;
  std::string err;
  const int fd = open_regular(e.path, 0, &st, &err);
  if (fd < 0) return err;
  const FileIdentity seen = identity_of(st);
  std::string changed = identity_mismatch(e.want, seen);
  if (!changed.empty()) {
    ::close(fd);
    return changed;
  }
  e.seen = seen;
  e.align = dio_align(fd);
  e.validated = true;
  e.fd[0] = fd;
  e.last_use = ++clock_;
  ++open_;
  return {};
}

void FileTable::refuse_direct(int64_t fi, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = files_[size_t(fi)];
  if (!e.refused.exchange(true)) e.refuse_why = why;
}

std::string FileTable::refuse_reason(int64_t fi) const {
  std::lock_guard<std::mutex> lock(mu_);
  return files_[size_t(fi)].refuse_why;
}

std::string FileTable::Lease::hold(FileTable* t, int64_t fi) {
  if (t_ == t && fi_ == fi) return {};
  reset();
  std::lock_guard<std::mutex> lock(t->mu_);
  Entry& e = t->files_[size_t(fi)];
  if (!e.validated) return "file was not validated before reading";
  ++e.refs;
  e.last_use = ++t->clock_;
  t_ = t;
  fi_ = fi;
  return {};
}

void FileTable::Lease::reset() {
  if (t_ == nullptr) return;
  std::lock_guard<std::mutex> lock(t_->mu_);
  --t_->files_[size_t(fi_)].refs;
  t_ = nullptr;
  fi_ = -1;
}

int FileTable::Lease::fd(bool direct, std::string* err, bool* refused) {
  std::lock_guard<std::mutex> lock(t_->mu_);
  Entry& e = t_->files_[size_t(fi_)];
  if (e.fd[direct ? 1 : 0] >= 0) return e.fd[direct ? 1 : 0];  // pinned: not evicted
  return t_->open_fd(e, direct, err, refused);
}

}  // namespace io
}  // namespace metamat
