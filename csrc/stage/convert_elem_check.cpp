// Test hook: the device conversion's per-element function (convert_elem.h) against the
// reader's host conversion (dtype.h) over fp32 bit patterns.
#include <cstdint>

#include "convert_elem_check.h"

#include "metamat/check.h"
#include "convert_elem.h"
#include "metamat/dtype.h"

namespace metamat {

ConvertElemCheck convert_elem_check(int dst_dtype, uint32_t stride) {
  MM_CHECK(dst_dtype == int(DType::kFloat16) || dst_dtype == int(DType::kBFloat16),
           "convert_elem_check: float16 or bfloat16");
  MM_CHECK(stride >= 1, "convert_elem_check: stride >= 1");
  ConvertElemCheck r;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += stride, ++r.checked) {
    const float f = bits_as_f32(uint32_t(u));
    const uint16_t want = dst_dtype == int(DType::kBFloat16) ? f32_to_bf16(f) : f32_to_f16(f);
    if (cvt_f32_to_half(uint32_t(u), dst_dtype) != want && r.mismatches++ == 0)
      r.first_input = uint32_t(u);
  }
  return r;
}

}  // namespace metamat
