// Direct I/O (O_DIRECT) helpers of the reader: aligned reads that bypass the page cache, and
// the page-cache residency probe that "auto" mode uses to choose direct or buffered reads.
#pragma once
#include <cstdint>
#include <string>

#include "io_fault.h"

namespace metamat {
namespace io {

inline int64_t align_down(int64_t x, int64_t a) { return x / a * a; }
inline int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Reads [a0, a0 + alen) of an O_DIRECT descriptor into `buf` (a0, alen and buf aligned to the
// file's direct-I/O alignment), until at least `need` bytes are in (a read may end early at
// the end of the file, past `need`). Large requests are the point: the kernel splits one
// multi-MiB O_DIRECT read into many block requests in flight at once. Returns the bytes
// obtained (>= need), or -1 with `*err` set; `*einval` tells a refusal (EINVAL: the file
// system will not do direct I/O on this file) from a real I/O error.
int64_t direct_pread(Fault& fault, int fd, unsigned char* buf, int64_t alen, int64_t a0,
                     int64_t need, int64_t align, std::string* err, bool* einval);

// Fraction of the pages of [off, off + len) of `fd` that are in the page cache (mincore on a
// mapping of the range: no data is read or faulted in), or -1 when it cannot be told.
double resident_fraction(int fd, int64_t off, int64_t len);

}  // namespace io
}  // namespace metamat
