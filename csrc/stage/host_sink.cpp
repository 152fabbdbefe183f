// The host ("fake copy") sink of the staging pipeline (stage.h): what CPU tests run instead of
// the CUDA sink, with the same ordering and error paths. Copies run on one worker thread in
// queue order, like a stream; an "event" is the queue sequence number at record(); wait()
// blocks until the worker has passed it.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "convert_elem.h"
#include "metamat/check.h"
#include "metamat/dtype.h"
#include "metamat/stage.h"

namespace metamat {
namespace io {

namespace {

class HostCopySink final : public CopySink {
 public:
  HostCopySink(const SinkSpec& spec, int ring)
      : delay_us_(spec.delay_us), fail_at_(spec.fail_copy_at),
        event_(size_t(ring), 0), pending_(size_t(ring), 0) {
    stats_.began = true;  // a host "stream" has nothing before it
    stage_thread_started();  // counted from here (the worker's exit uncounts it)
    try {
      worker_ = std::thread([this] { loop(); });
    } catch (...) {  // std::system_error: nothing started
      stage_thread_ended();
      throw;
    }
  }
  ~HostCopySink() override {
    drain();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  void copy(const CopyItem& item, int buffer) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_at_ >= 0 && stats_.copies == fail_at_)
      fail(__FILE__, __LINE__, "injected copy failure at copy " + std::to_string(fail_at_));
    if (!error_.empty()) fail(__FILE__, __LINE__, "host copy sink: " + error_);
    jobs_.push_back({item, buffer});
    ++queued_;
    ++pending_[size_t(buffer)];
    ++stats_.copies;
    stats_.bytes += item.rows * item.row_bytes;
    stats_.max_pending = std::max<int64_t>(stats_.max_pending, int64_t(jobs_.size()));
    cv_.notify_all();
  }
  void record(int buffer) override {
    std::lock_guard<std::mutex> lock(mu_);
    event_[size_t(buffer)] = queued_;
    ++stats_.records;
  }
  void wait(int buffer) override {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t target = event_[size_t(buffer)];
    if (target == 0) return;
    ++stats_.waits;
    done_cv_.wait(lock, [&] { return done_ >= target; });
  }
  void filling(int buffer) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_[size_t(buffer)] != 0) ++stats_.reuse_violations;
  }
  void finish() override {
    drain();
    std::lock_guard<std::mutex> lock(mu_);
    stats_.finished = true;
    if (!error_.empty()) fail(__FILE__, __LINE__, "host copy sink: " + error_);
  }
  void drain() noexcept override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_ >= queued_; });
  }
  SinkStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  struct Job {
    CopyItem item;
    int buffer;
  };
  void loop() noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) break;  // stop_ and nothing left
      const Job j = jobs_.front();
      lock.unlock();
      if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
      const CopyItem& c = j.item;
      auto* dst = reinterpret_cast<unsigned char*>(c.dst);
      if (c.convert != 0) {  // the device-side conversion, done here as the kernel does it
        const int64_t elems = c.row_bytes / 4;
        for (int64_t r = 0; r < c.rows; ++r) {
          const unsigned char* src = c.src + r * c.row_bytes;
          unsigned char* d = dst + r * c.dst_stride;
          for (int64_t e = 0; e < elems; ++e) {
            uint32_t u;
            std::memcpy(&u, src + 4 * e, 4);
            const uint16_t h = cvt_f32_to_half(u, c.convert);
            std::memcpy(d + 2 * e, &h, 2);
          }
        }
      } else if (c.rows == 1 || c.dst_stride == c.row_bytes) {
        std::memcpy(dst, c.src, size_t(c.rows * c.row_bytes));
      } else {
        for (int64_t r = 0; r < c.rows; ++r)
          std::memcpy(dst + r * c.dst_stride, c.src + r * c.row_bytes, size_t(c.row_bytes));
      }
      lock.lock();
      jobs_.pop_front();
      --pending_[size_t(j.buffer)];
      ++done_;
      done_cv_.notify_all();
    }
    lock.unlock();
    stage_thread_ended();
  }

  const int64_t delay_us_, fail_at_;
  mutable std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job> jobs_;
  int64_t queued_ = 0, done_ = 0;
  std::vector<int64_t> event_;    // per buffer: queued_ at its last record()
  std::vector<int64_t> pending_;  // per buffer: copies queued, not done
  std::string error_;
  bool stop_ = false;
  SinkStats stats_;
  std::thread worker_;  // last: started after everything it uses exists
};

}  // namespace

std::unique_ptr<CopySink> make_host_sink(const SinkSpec& spec, int ring) {
  return std::unique_ptr<CopySink>(new HostCopySink(spec, ring));
}

}  // namespace io
}  // namespace metamat
