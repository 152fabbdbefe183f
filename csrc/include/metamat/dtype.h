// The element types of the core and the float conversions between them, shared by the init
// engine (fill_*) and the checkpoint reader (io_reader). One enum, one set of conversions.
//
// Codes are part of the Python seam: metamat/_dtypes.py mirrors them and a test compares the
// two through `_C.DTYPE_CODES`. Conversions round to nearest even and are bit-exact with c10's
// scalar conversions (and with F16C / CUDA __float2half_rn / __float2bfloat16_rn).
#pragma once
#include <cstdint>
#include <cstring>

namespace metamat {

// kRaw: bytes copied as they are (the reader's "no conversion"; never a fill target).
enum class DType : int32_t { kRaw = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3, kFloat64 = 4 };

// Bytes per element; 0 for kRaw and unknown codes.
inline int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    default: return 0;
  }
}

// The dtypes the reader converts between.
inline bool is_convertible_float(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16;
}

inline uint32_t f32_as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_as_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp16 -> fp32, from the FP16 library (as vendored in c10/util/Half.h).
inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = 0x1.0p-112f;
  const float normalized = bits_as_f32((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = bits_as_f32((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_as_bits(denormalized) : f32_as_bits(normalized));
  return bits_as_f32(result);
}

// fp32 -> fp16, round to nearest even; NaN -> 0x7E00 with the sign (c10's rule).
inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  const uint32_t w = f32_as_bits(f);
  float base = (bits_as_f32(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_as_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_as_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_f32(uint16_t b) { return bits_as_f32(uint32_t(b) << 16); }

// fp32 -> bf16, c10::detail::round_to_nearest_even, branch-free so loops vectorise.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_as_bits(f);
  const uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return uint16_t(nan ? 0x7FC0u : rounded);
}

}  // namespace metamat
