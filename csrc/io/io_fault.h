// I/O fault injection for tests (METAMAT_IO_FAULT): the k-th read of a call misbehaves.
//
// METAMAT_IO_FAULT="<k>:<mode>": `eio` fails with EIO, `eof` returns 0 (file shrank), `short`
// returns about half the bytes asked (direct reads: rounded down to the alignment; must be
// retried transparently), `eintr` fails with EINTR (retried), `einval` fails with EINVAL (a
// direct read then falls back to buffered reads of that file; a buffered read fails).
// "<k>:nodirect" makes every O_DIRECT open of the call answer EINVAL (k is ignored): the
// per-file fallback to buffered reads. Read once per call; unset or malformed: nothing.
#pragma once
#include <errno.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace metamat {
namespace io {

enum class FaultMode { kNone, kEio, kShort, kEof, kEintr, kEinval, kNoDirect };

struct Fault {
  FaultMode mode = FaultMode::kNone;
  int64_t nth = 0;                // 1-based index of the read call that misbehaves
  std::atomic<int64_t> calls{0};  // read calls made so far in this call

  static FaultMode parse_mode(const std::string& m) {
    return m == "eio" ? FaultMode::kEio : m == "short" ? FaultMode::kShort
         : m == "eof" ? FaultMode::kEof : m == "eintr" ? FaultMode::kEintr
         : m == "einval" ? FaultMode::kEinval : m == "nodirect" ? FaultMode::kNoDirect
         : FaultMode::kNone;
  }
  // From METAMAT_IO_FAULT; leaves the fault disabled when it is unset or malformed.
  void from_env() {
    const char* v = std::getenv("METAMAT_IO_FAULT");
    if (v == nullptr || *v == 0) return;
    char* end = nullptr;
    const long long k = std::strtoll(v, &end, 10);
    if (end == v || *end != ':' || k < 1) return;
    nth = k;
    mode = parse_mode(std::string(end + 1));
  }
  bool refuse_direct_open() const { return mode == FaultMode::kNoDirect; }

  // ::pread, unless this is the call the plan picks. `align` > 0 for direct reads (a short
  // read then stays aligned, as a real one does).
  ssize_t pread(int fd, void* buf, size_t want, off_t off, int64_t align) {
    if (mode != FaultMode::kNone && mode != FaultMode::kNoDirect &&
        calls.fetch_add(1) + 1 == nth) {
      switch (mode) {
        case FaultMode::kEio: errno = EIO; return -1;
        case FaultMode::kEintr: errno = EINTR; return -1;
        case FaultMode::kEinval: errno = EINVAL; return -1;
        case FaultMode::kEof: return 0;
        case FaultMode::kShort: {
          size_t half = want > 1 ? want / 2 : want;
          if (align > 0) half = half / size_t(align) * size_t(align);
          if (half == 0) half = want;
          return ::pread(fd, buf, half, off);
        }
        default: break;
      }
    }
    return ::pread(fd, buf, want, off);
  }
};

}  // namespace io
}  // namespace metamat
