// Test hook: the device conversion's per-element function (convert_elem.h) checked against the
// reader's host conversion (dtype.h) over fp32 bit patterns, every `stride`-th one.
#pragma once
#include <cstdint>

namespace metamat {

struct ConvertElemCheck {
  int64_t checked = 0, mismatches = 0;
  uint32_t first_input = 0;
};

ConvertElemCheck convert_elem_check(int dst_dtype, uint32_t stride);

}  // namespace metamat
