// Built instead of stage_cuda.cu when the CUDA backend is off: no CUDA sink, no pinned memory.
#include "metamat/check.h"
#include "metamat/stage.h"

namespace metamat {
namespace io {

void* pinned_alloc(int64_t, int) {
  MM_CHECK(false, "metamat was built without its CUDA backend: no pinned staging buffers "
                  "(rebuild with METAMAT_CUDA=1)");
  return nullptr;
}
void pinned_free(void*) noexcept {}
uintptr_t host_pointer(uintptr_t) noexcept { return 0; }

std::unique_ptr<CopySink> make_cuda_sink(const SinkSpec&, int) {
  MM_CHECK(false, "metamat was built without its CUDA backend: no CUDA copy sink "
                  "(rebuild with METAMAT_CUDA=1)");
  return nullptr;
}

}  // namespace io
}  // namespace metamat
