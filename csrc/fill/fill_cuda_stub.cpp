// Built instead of fill_cuda.cu when the CUDA backend is off (METAMAT_CUDA=0 or no nvcc).
#include "metamat/check.h"
#include "metamat/fill.h"

namespace metamat {

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
void fill_cuda(const Segment*, int64_t, Segment*, void*, void*, FillOptions) {
  MM_CHECK(false, "metamat was built without its CUDA backend (rebuild with METAMAT_CUDA=1)");
}

}  // namespace metamat
