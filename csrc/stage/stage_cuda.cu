// The CUDA copy sink of the staging pipeline (stage.h) and page-locked staging memory.
// Torch-free: the caller's stream arrives as an integer (torch.cuda.current_stream(d).cuda_stream).
// Every call runs under a device guard (cudaSetDevice to the destination's device, restored
// after), so a destination on a non-current device is copied on its own device's stream.
#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <vector>

#include <algorithm>

#include "metamat/check.h"
#include "convert_elem.h"
#include "metamat/detail/cuda_check.h"
#include "metamat/stage.h"


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

// METAMAT_CONVERT_ON=device: fp32 rows (contiguous in the device scratch area) to fp16/bf16
// destination rows of `dst_stride` bytes, element by element with convert_elem.h (the host
// conversion's operations). `row_elems` even and pointers 4-byte aligned: two per thread.
__global__ void convert_rows_kernel(const uint32_t* __restrict__ src, int64_t row_elems,
                                    int64_t rows, unsigned char* __restrict__ dst,
                                    int64_t dst_stride, int dtype) {
  const int64_t n = row_elems * rows;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const bool contiguous = rows == 1 || dst_stride == 2 * row_elems;
  const bool pairs = (row_elems % 2) == 0 && (reinterpret_cast<uintptr_t>(dst) % 4) == 0 &&
                     (dst_stride % 4) == 0;
  if (pairs) {
    for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 2; i < n; i += 2 * step) {
      const int64_t r = contiguous ? 0 : i / row_elems, c = contiguous ? i : i - r * row_elems;
      const uint2 v = *reinterpret_cast<const uint2*>(src + i);
      const uint32_t out = uint32_t(cvt_f32_to_half(v.x, dtype)) |
                           (uint32_t(cvt_f32_to_half(v.y, dtype)) << 16);
      *reinterpret_cast<uint32_t*>(dst + r * dst_stride + 2 * c) = out;
    }
  } else {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
      const int64_t r = contiguous ? 0 : i / row_elems, c = contiguous ? i : i - r * row_elems;
      *reinterpret_cast<uint16_t*>(dst + r * dst_stride + 2 * c) = cvt_f32_to_half(src[i], dtype);
    }
  }
}

class CudaCopySink final : public CopySink {
 public:
  CudaCopySink(const SinkSpec& spec, int ring)
      : dev_(spec.device), caller_(reinterpret_cast<cudaStream_t>(spec.stream)),
        buffer_bytes_(spec.buffer_bytes), scratch_(size_t(ring), nullptr),
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
    for (void* p : scratch_)
      if (p != nullptr) cudaFree(p);  // after drain: no kernel reads them any more
    // members: events then the stream are destroyed (any device may be current)
  }

  void copy(const CopyItem& c, int buffer) override {
    DeviceGuard g(dev_);
    auto* dst = reinterpret_cast<void*>(c.dst);
    if (c.convert != 0) {
      // fp32 rows into the buffer's device scratch area (its layout mirrors the staging
      // buffer's, so items of one chunk never overlap), then converted into the destination;
      // stream order keeps the next chunk's copy into this area behind the kernel.
      void*& area = scratch_[size_t(buffer)];
      if (area == nullptr) MM_CUDA_CHECK(cudaMalloc(&area, size_t(buffer_bytes_)));
      MM_CHECK(c.offset + c.rows * c.row_bytes <= buffer_bytes_, "conversion item past its buffer");
      auto* s = static_cast<unsigned char*>(area) + c.offset;
      MM_CUDA_CHECK(cudaMemcpyAsync(s, c.src, size_t(c.rows * c.row_bytes),
                                    cudaMemcpyHostToDevice, stream_.get()));
      const int64_t elems = c.row_bytes / 4 * c.rows;
      const int64_t blocks = std::min<int64_t>((elems + 511) / 512, 4096);
      convert_rows_kernel<<<unsigned(std::max<int64_t>(blocks, 1)), 256, 0, stream_.get()>>>(
          reinterpret_cast<const uint32_t*>(s), c.row_bytes / 4, c.rows,
          reinterpret_cast<unsigned char*>(dst), c.dst_stride, c.convert);
      MM_CUDA_CHECK(cudaGetLastError());
      ++stats_.copies;
      stats_.bytes += c.rows * c.row_bytes;
      return;
    }
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
  int64_t buffer_bytes_;
  std::vector<void*> scratch_;  // per ring buffer: device fp32 rows awaiting conversion
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

uintptr_t host_pointer(uintptr_t ptr) noexcept {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(ptr)) != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows: clear the error, answer "none"
    return 0;
  }
  return a.type == cudaMemoryTypeHost ? reinterpret_cast<uintptr_t>(a.hostPointer) : 0;
}

std::unique_ptr<CopySink> make_cuda_sink(const SinkSpec& spec, int ring) {
  MM_CHECK(spec.device >= 0, "CUDA sink needs a device index");
  return std::unique_ptr<CopySink>(new CudaCopySink(spec, ring));
}

}  // namespace io
}  // namespace metamat
