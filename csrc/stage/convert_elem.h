// fp32 -> fp16 / bf16 of one element, for host and device: the conversion the staging pipeline
// runs on the GPU after the copy (METAMAT_CONVERT_ON=device, io_stage_convert.cu) and, in CPU
// tests, in the host copy sink. The same operations as dtype.h's f32_to_f16 / f32_to_bf16 (the
// reader's host conversion: round to nearest even, c10's NaN rules); tests compare the two over
// every fp32 bit pattern (_C.convert_elem_check).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MM_CVT_HD __host__ __device__ __forceinline__
#else
#define MM_CVT_HD inline
#endif

namespace metamat {

MM_CVT_HD float cvt_bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}
MM_CVT_HD uint32_t cvt_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}

// dtype.h f32_to_bf16: c10::detail::round_to_nearest_even; NaN -> 0x7FC0.
MM_CVT_HD uint16_t cvt_f32_to_bf16(uint32_t u) {
  const uint32_t rounded = (u + ((u >> 16) & 1u) + 0x7FFFu) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return uint16_t(nan ? 0x7FC0u : rounded);
}

// dtype.h f32_to_f16 (the FP16 library's): round to nearest even; NaN -> 0x7E00 with the sign.
MM_CVT_HD uint16_t cvt_f32_to_f16(uint32_t w) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (cvt_bits_f32(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = cvt_bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = cvt_f32_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// dst_dtype: DType code (dtype.h) 2 = float16, 3 = bfloat16; other codes are not converted here.
MM_CVT_HD uint16_t cvt_f32_to_half(uint32_t u, int dst_dtype) {
  return dst_dtype == 3 ? cvt_f32_to_bf16(u) : cvt_f32_to_f16(u);
}

}  // namespace metamat
