// float32 -> float16 / bfloat16 bit conversions, round to nearest even, on the host.
// Bit-exact with the hardware conversions (F16C, CUDA __float2half_rn/__float2bfloat16_rn).
#pragma once
#include <cstdint>

#include "philox.h"

namespace metamat {

inline uint16_t to_half_bits(float v) {  // round to nearest even (F. Giesen)
  uint32_t f = float_to_bits(v);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t o;
  if (f >= (143u << 23)) {
    o = f > (255u << 23) ? 0x7e00u : 0x7c00u;
  } else if (f < (113u << 23)) {
    o = float_to_bits(bits_to_float(f) + bits_to_float(126u << 23)) - (126u << 23);
  } else {
    const uint32_t mant_odd = (f >> 13) & 1u;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu;
    f += mant_odd;
    o = f >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline uint16_t to_bf16_bits(float v) {  // round to nearest even; values are never NaN
  uint32_t u = float_to_bits(v);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace metamat
