// The CUDA copy sink of the staging pipeline (io_stage.h) and page-locked staging memory.
// Torch-free: the caller's stream arrives as an integer (torch.cuda.current_stream(d).cuda_stream).
// Every call runs under a device guard (cudaSetDevice to the destination's device, restored
// after), so a destination on a non-current device is copied on its own device's stream.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "cuda_check.h"
#include "io_stage.h"


namespace metamat {
namespace io {

void pinned_free(void* p) noexcept {
  if (p != nullptr) cudaFreeHost(p);
}

namespace {

// cudaSetDevice(dev) for the guard's lifetime; the previous device is restored after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int dev) {
    MM_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != dev) {
      MM_CUDA_CHECK(cudaSetDevice(dev));
      set_ = true;
    }
  }
  ~DeviceGuard() {
    if (set_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool set_ = false;
};

struct StreamDel {
  void operator()(CUstream_st* s) const noexcept { cudaStreamDestroy(s); }
};
struct EventDel {
  void operator()(CUevent_st* e) const noexcept { cudaEventDestroy(e); }
};
using StreamPtr = std::unique_ptr<CUstream_st, StreamDel>;
using EventPtr = std::unique_ptr<CUevent_st, EventDel>;

EventPtr new_event() {
  cudaEvent_t e = nullptr;
  MM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return EventPtr(e);
}

// Largest pitch cudaMemcpy2DAsync takes; wider strides are copied row by row.
constexpr int64_t kMaxPitch = (int64_t(1) << 31) - 1;

class CudaCopySink final : public CopySink {
 public:
  CudaCopySink(const SinkSpec& spec, int ring)
      : dev_(spec.device), caller_(reinterpret_cast<cudaStream_t>(spec.stream)),
        recorded_(size_t(ring), false) {
    DeviceGuard g(dev_);
    cudaStream_t s = nullptr;
    MM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_.reset(s);
    for (int k = 0; k < ring; ++k) events_.push_back(new_event());
    start_ = new_event();
    done_ = new_event();
    // The caller may still be using the memory the copies overwrite: copy after its work.
    MM_CUDA_CHECK(cudaEventRecord(start_.get(), caller_));
    MM_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), start_.get(), 0));
    stats_.began = true;
  }
  ~CudaCopySink() override {
    drain();
    // members: events then the stream are destroyed (any device may be current)
  }

  void copy(const CopyItem& c, int /*buffer*/) override {
    DeviceGuard g(dev_);
    auto* dst = reinterpret_cast<void*>(c.dst);
    if (c.rows == 1 || c.dst_stride == c.row_bytes) {
      MM_CUDA_CHECK(cudaMemcpyAsync(dst, c.src, size_t(c.rows * c.row_bytes),
                                    cudaMemcpyHostToDevice, stream_.get()));
    } else if (c.dst_stride <= kMaxPitch && c.row_bytes <= kMaxPitch) {
      MM_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(c.dst_stride), c.src, size_t(c.row_bytes),
                                      size_t(c.row_bytes), size_t(c.rows),
                                      cudaMemcpyHostToDevice, stream_.get()));
    } else {
      for (int64_t r = 0; r < c.rows; ++r)
        MM_CUDA_CHECK(cudaMemcpyAsync(static_cast<unsigned char*>(dst) + r * c.dst_stride,
                                      c.src + r * c.row_bytes, size_t(c.row_bytes),
                                      cudaMemcpyHostToDevice, stream_.get()));
    }
    ++stats_.copies;
    stats_.bytes += c.rows * c.row_bytes;
  }
  void record(int buffer) override {
    DeviceGuard g(dev_);
    MM_CUDA_CHECK(cudaEventRecord(events_[size_t(buffer)].get(), stream_.get()));
    recorded_[size_t(buffer)] = true;
    ++stats_.records;
  }
  void wait(int buffer) override {
    if (!recorded_[size_t(buffer)]) return;
    DeviceGuard g(dev_);
    MM_CUDA_CHECK(cudaEventSynchronize(events_[size_t(buffer)].get()));
    ++stats_.waits;
  }
  void finish() override {
    DeviceGuard g(dev_);
    // Work the caller queues after the load sees the loaded bytes.
    MM_CUDA_CHECK(cudaEventRecord(done_.get(), stream_.get()));
    MM_CUDA_CHECK(cudaStreamWaitEvent(caller_, done_.get(), 0));
    // The staging buffers are freed next: every copy out of them must be done.
    MM_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
    stats_.finished = true;
  }
  void drain() noexcept override {
    if (!stream_) return;
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != dev_) cudaSetDevice(dev_);
    cudaStreamSynchronize(stream_.get());
    if (prev >= 0 && prev != dev_) cudaSetDevice(prev);
  }
  SinkStats stats() const override { return stats_; }

 private:
  int dev_;
  cudaStream_t caller_;
  // Declared before the events: destroyed after them.
  StreamPtr stream_;
  std::vector<EventPtr> events_;
  EventPtr start_, done_;
  std::vector<bool> recorded_;
  SinkStats stats_;
};

}  // namespace

void* pinned_alloc(int64_t bytes, int device) {
  DeviceGuard g(device);
  void* p = nullptr;
  // Under unified addressing page-locked memory is usable by every device (portable).
  MM_CUDA_CHECK(cudaHostAlloc(&p, size_t(bytes), cudaHostAllocDefault));
  return p;
}

std::unique_ptr<CopySink> make_cuda_sink(const SinkSpec& spec, int ring) {
  MM_CHECK(spec.device >= 0, "CUDA sink needs a device index");
  return std::unique_ptr<CopySink>(new CudaCopySink(spec, ring));
}

}  // namespace io
}  // namespace metamat
