// Read-ahead for the reader's O_DIRECT path: one helper thread per reader thread issues the
// next aligned read into one of two slots of the reader's bounce buffer while the reader
// copies the previous slot into the destination.
//
// Why: checkpoint data starts at unaligned file offsets, so a direct read lands in the bounce
// buffer and is memcpy'd into the model's fresh pages (page faults on the way). Done serially,
// the device idles during every copy and the CPU during every read; with the helper the copy
// of window k overlaps the read of window k+1 (and the reader's next task's first window), so
// a reader thread keeps one request in flight all the time instead of about half of it.
//
// The helper only runs direct_pread (blocking, retried exactly like the serial path, fault
// injection included) into memory the caller owns; the caller decides which window goes into
// which slot, waits for it, and accounts for the bytes when it uses them (a window read ahead
// and never used is not counted as read). Nothing here throws after construction; the
// destructor stops the helper and joins it (at most one read still in flight) on every path.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>

#include "io_fault.h"
#include "metamat/detail/thread_group.h"

namespace metamat {
namespace io {

class DirectAhead {
 public:
  // One aligned O_DIRECT read: [a0, a0 + alen) of descriptor fd (file fi), at least `need`
  // bytes (a read may stop at the end of the file past `need`).
  struct Window {
    int64_t fi = -1;
    int fd = -1;
    int64_t a0 = 0, alen = 0, need = 0, align = 0;
    bool valid() const { return fd >= 0 && alen > 0; }
    bool operator==(const Window& o) const {
      return fi == o.fi && fd == o.fd && a0 == o.a0 && alen == o.alen && need == o.need;
    }
  };
  struct Result {
    int64_t got = -1;  // bytes obtained (>= need), or -1 with err set
    std::string err;
    bool einval = false;  // the read answered EINVAL (direct I/O refused for this file)
  };

  explicit DirectAhead(Fault& fault) : fault_(fault) {}
  ~DirectAhead();
  DirectAhead(const DirectAhead&) = delete;
  DirectAhead& operator=(const DirectAhead&) = delete;

  // Slots [slot0, slot0 + bytes) and [slot1, slot1 + bytes) (aligned, not overlapping, owned
  // by the caller and alive until this is destroyed). Starts the helper thread (ThreadGroup:
  // METAMAT_THREAD_FAULT applies); false when it cannot start (the caller reads serially).
  bool start(unsigned char* slot0, unsigned char* slot1, int64_t bytes);

  int64_t slot_bytes() const { return bytes_; }
  unsigned char* slot(int s) const { return buf_[s]; }
  // The slot holding (or reading) w, or -1.
  int find(const Window& w);
  // Queues w into slot s, which must be free (see release/drain).
  void submit(int s, const Window& w);
  // Waits until slot s's read is done and returns its result; the slot keeps its bytes until
  // release(s).
  Result wait(int s);
  // Slot s is free again (waits for a read in flight into it first).
  void release(int s);
  // Every slot free (waits for reads in flight): before the bounce buffer is used otherwise,
  // or before the descriptor a queued window names may be closed.
  void drain();

 private:
  enum class State { kFree, kQueued, kReading, kDone };
  struct Slot {
    Window w;
    State st = State::kFree;
    Result r;
    uint64_t seq = 0;
  };
  void run();
  void release_locked(int s, std::unique_lock<std::mutex>& lock);

  Fault& fault_;
  unsigned char* buf_[2] = {nullptr, nullptr};
  int64_t bytes_ = 0;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  Slot slots_[2];
  uint64_t seq_ = 0;
  bool stop_ = false;
  ThreadGroup group_;  // last: joined (by the destructor) before the rest goes
};

}  // namespace io
}  // namespace metamat
