// fp32 <-> fp16/bf16 conversion of the reader (dtype.h rules: round to nearest even, as c10).
#include <cstring>

#include "metamat/io_reader.h"

namespace metamat {
namespace io {

namespace {

// ---- element conversion (dtype.h; round to nearest even, as c10) ----

inline float load_as_f32(const unsigned char* p, DType t) {
  if (t == DType::kFloat32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == DType::kFloat16 ? f16_to_f32(h) : bf16_to_f32(h);
}

inline void store_f32(unsigned char* p, DType t, float f) {
  if (t == DType::kFloat32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = t == DType::kFloat16 ? f32_to_f16(f) : f32_to_bf16(f);
  std::memcpy(p, &h, 2);
}

// Specialised loops so the common cases vectorise (the switch is hoisted out of the loop).
template <DType S, DType D>
inline __attribute__((always_inline)) void convert_loop(const unsigned char* src, unsigned char* dst, int64_t n) {
  constexpr int64_t ss = S == DType::kFloat32 ? 4 : 2;
  constexpr int64_t ds = D == DType::kFloat32 ? 4 : 2;
  for (int64_t i = 0; i < n; ++i) store_f32(dst + i * ds, D, load_as_f32(src + i * ss, S));
}

}  // namespace

// Built twice (AVX2 and baseline) and picked at load time: conversion is the only compute.
// Not under ThreadSanitizer: its ifunc resolver would run before TSan's runtime starts.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
static void convert_impl(const unsigned char* in, DType s, unsigned char* out, DType d,
                         int64_t n) {
#define MM_CONV(S, D) \
  if (s == DType::S && d == DType::D) return convert_loop<DType::S, DType::D>(in, out, n);
  MM_CONV(kFloat32, kFloat16) MM_CONV(kFloat32, kBFloat16) MM_CONV(kFloat16, kFloat32)
  MM_CONV(kBFloat16, kFloat32) MM_CONV(kFloat16, kBFloat16) MM_CONV(kBFloat16, kFloat16)
  MM_CONV(kFloat32, kFloat32) MM_CONV(kFloat16, kFloat16) MM_CONV(kBFloat16, kBFloat16)
#undef MM_CONV
}

void convert(const void* src, DType s, void* dst, DType d, int64_t n) {
  convert_impl(static_cast<const unsigned char*>(src), s, static_cast<unsigned char*>(dst), d, n);
}

}  // namespace io
}  // namespace metamat
