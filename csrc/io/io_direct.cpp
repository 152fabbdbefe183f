// O_DIRECT reads and the page-cache probe. See io_direct.h.
#include "io_direct.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace metamat {
namespace io {

int64_t direct_pread(Fault& fault, int fd, unsigned char* buf, int64_t alen, int64_t a0,
                     int64_t need, int64_t align, std::string* err, bool* einval) {
  int64_t got_total = 0;
  *einval = false;
  while (got_total < need) {
    const int64_t want = std::min<int64_t>(alen - got_total, int64_t(1) << 30);
    const ssize_t got =
        fault.pread(fd, buf + got_total, size_t(want), off_t(a0 + got_total), align);
    if (got < 0) {
      if (errno == EINTR) continue;
      *einval = errno == EINVAL;
      *err = std::string("O_DIRECT pread failed at offset ") + std::to_string(a0 + got_total) +
             ": " + std::strerror(errno);
      return -1;
    }
    if (got == 0) {
      *err = "unexpected end of file at offset " + std::to_string(a0 + got_total);
      return -1;
    }
    got_total += got;
    // A short read that is not aligned can only be the end of the file; the next read would
    // be refused (EINVAL), so it must have brought everything needed.
    if (got_total < need && got_total % align != 0) {
      *err = "unexpected end of file at offset " + std::to_string(a0 + got_total);
      return -1;
    }
  }
  return got_total;
}

double resident_fraction(int fd, int64_t off, int64_t len) {
  static const int64_t page = [] {
    const long p = ::sysconf(_SC_PAGESIZE);
    return int64_t(p > 0 ? p : 4096);
  }();
  if (len <= 0) return 1.0;
  const int64_t a0 = align_down(off, page), a1 = align_up(off + len, page);
  // The mapping's pages are never touched (mincore only asks whether they are resident), so
  // a file that shrinks meanwhile cannot raise SIGBUS here; nothing else in metamat maps a
  // checkpoint file (bindings_zip.cpp preads).
  void* m = ::mmap(nullptr, size_t(a1 - a0), PROT_READ, MAP_SHARED, fd, off_t(a0));
  if (m == MAP_FAILED) return -1.0;
  std::vector<unsigned char> vec(size_t((a1 - a0) / page));
  const int rc = ::mincore(m, size_t(a1 - a0), vec.data());
  ::munmap(m, size_t(a1 - a0));
  if (rc != 0) return -1.0;
  int64_t in = 0;
  for (unsigned char v : vec) in += v & 1;
  return double(in) / double(vec.size());
}

}  // namespace io
}  // namespace metamat
