// The direct-read helper thread: see io_ahead.h.
#include "io_ahead.h"

#include "io_direct.h"

namespace metamat {
namespace io {

DirectAhead::~DirectAhead() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  group_.join();
}

bool DirectAhead::start(unsigned char* slot0, unsigned char* slot1, int64_t bytes) {
  buf_[0] = slot0;
  buf_[1] = slot1;
  bytes_ = bytes;
  return group_.spawn([this] { run(); });
}

int DirectAhead::find(const Window& w) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int s = 0; s < 2; ++s)
    if (slots_[s].st != State::kFree && slots_[s].w == w) return s;
  return -1;
}

void DirectAhead::submit(int s, const Window& w) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& sl = slots_[s];
    sl.w = w;
    sl.r = Result();
    sl.st = State::kQueued;
    sl.seq = ++seq_;
  }
  work_cv_.notify_one();
}

DirectAhead::Result DirectAhead::wait(int s) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return slots_[s].st == State::kDone || slots_[s].st == State::kFree; });
  if (slots_[s].st == State::kFree) {  // (not reachable through OpReader: a queued slot is waited)
    Result r;
    r.err = "read-ahead slot was not queued";
    return r;
  }
  return slots_[s].r;
}

void DirectAhead::release_locked(int s, std::unique_lock<std::mutex>& lock) {
  Slot& sl = slots_[s];
  if (sl.st == State::kQueued) {  // not started: take it back
    sl.st = State::kFree;
    return;
  }
  done_cv_.wait(lock, [&] { return sl.st != State::kReading; });
  sl.st = State::kFree;
  sl.r = Result();
}

void DirectAhead::release(int s) {
  std::unique_lock<std::mutex> lock(mu_);
  release_locked(s, lock);
}

void DirectAhead::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  for (int s = 0; s < 2; ++s) release_locked(s, lock);
}

void DirectAhead::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    int s = -1;
    work_cv_.wait(lock, [&] {
      if (stop_) return true;
      for (int k = 0; k < 2; ++k)
        if (slots_[k].st == State::kQueued && (s < 0 || slots_[k].seq < slots_[s].seq)) s = k;
      return s >= 0;
    });
    if (stop_) return;
    Slot& sl = slots_[s];
    sl.st = State::kReading;
    const Window w = sl.w;
    lock.unlock();
    Result r;
    try {
      r.got = direct_pread(fault_, w.fd, buf_[s], w.alen, w.a0, w.need, w.align, &r.err,
                           &r.einval);
    } catch (...) {  // bad_alloc building a message: report a failure, never escape
      r = Result();
      r.got = -1;
    }
    if (r.got < 0 && r.err.empty()) {
      try {
        r.err = "O_DIRECT read failed";
      } catch (...) {
      }
    }
    lock.lock();
    sl.r = std::move(r);
    sl.st = State::kDone;
    done_cv_.notify_all();
  }
}

}  // namespace io
}  // namespace metamat
