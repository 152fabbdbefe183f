// Row-wise quantization into fbgemm's inference TBE rows (see quant_rowwise.h): a scalar
// kernel and an AVX2 + F16C one, chosen at run time, giving the same bytes.
#include "metamat/quant_rowwise.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "metamat/check.h"
#include "metamat/dtype.h"
#include "io/io_prefault.h"
#include "metamat/detail/thread_group.h"

namespace metamat {
namespace quant {

namespace {

bool is_int(int64_t kind) { return kind == 2 || kind == 4 || kind == 8; }

struct RowParams {
  float min;  // the fp16-rounded minimum (the bias, as a float)
  float inv;  // 1 / scale
  uint16_t scale_h, bias_h;
};

// fbgemm's parameters from a row's min and max (FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf).
RowParams params_of(float mn, float mx, int bits) {
  RowParams p;
  p.bias_h = f32_to_f16(mn);
  mn = f16_to_f32(p.bias_h);
  const float range = mx - mn;
  float scale = range == 0 ? 1.0f : range / float((1 << bits) - 1);
  scale = f16_to_f32(f32_to_f16(scale));
  if (scale == 0) scale = 1.0f;  // maximum == minimum: any scale works, X - min is 0
  float inv = 1.0f / scale;
  if (std::isinf(inv)) {
    scale = 1.0f;
    inv = 1.0f;
  }
  p.scale_h = f32_to_f16(scale);
  p.min = mn;
  p.inv = inv;
  return p;
}

// A minimum of zero is the row's first zero, +0.0 or -0.0: the sign goes into the bias bytes,
// and fbgemm 1.9's op keeps the first of equal minima (1.8 folded 8 lanes, another order).
inline float first_zero(const float* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (x[c] == 0.0f) return x[c];
  return 0.0f;
}

// 8 lanes over the whole chunks of 8, the lanes folded in order, then the tail (as fbgemm's
// AVX2 kernel); a zero minimum then takes the sign of the row's first zero.
void minmax_scalar(const float* x, int64_t n, float* mn, float* mx) {
  float lmin[8], lmax[8];
  for (int j = 0; j < 8; ++j) {
    lmin[j] = FLT_MAX;
    lmax[j] = -FLT_MAX;
  }
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int j = 0; j < 8; ++j) {
      const float v = x[c + j];
      lmin[j] = lmin[j] < v ? lmin[j] : v;
      lmax[j] = lmax[j] > v ? lmax[j] : v;
    }
  float a = FLT_MAX, b = -FLT_MAX;
  for (int j = 0; j < 8; ++j) {
    a = std::min(a, lmin[j]);
    b = std::max(b, lmax[j]);
  }
  for (; c < n; ++c) {
    a = std::min(a, x[c]);
    b = std::max(b, x[c]);
  }
  *mn = a == 0.0f ? first_zero(x, n) : a;
  *mx = b;
}

inline uint8_t q_scalar(float x, const RowParams& p, int maxq) {
  // lrintf rounds half to even (the default rounding mode), as _mm256_cvtps_epi32 does.
  const int v = static_cast<int>(std::lrintf((x - p.min) * p.inv));
  return static_cast<uint8_t>(std::max(0, std::min(v, maxq)));
}

// Elements [c, o.cols) of one destination row (the scalar tail of either kernel).
void data_scalar(const float* xs, int64_t c, const QuantOut& o, const RowParams& p,
                 unsigned char* data) {
  const int64_t kind = o.kind;
  if (kind == int64_t(QKind::kFp32)) {
    std::memcpy(data + 4 * c, xs + c, size_t(4 * (o.cols - c)));
    return;
  }
  if (kind == int64_t(QKind::kFp16)) {
    for (; c < o.cols; ++c) {
      const uint16_t h = f32_to_f16(xs[c]);
      std::memcpy(data + 2 * c, &h, 2);
    }
    return;
  }
  const int bits = int(kind), epb = 8 / bits, maxq = (1 << bits) - 1;
  for (; c < o.cols; c += epb) {
    uint32_t byte = 0;
    for (int k = 0; k < epb; ++k) byte |= uint32_t(q_scalar(xs[c + k], p, maxq)) << (k * bits);
    data[c / epb] = static_cast<unsigned char>(byte);
  }
}

// Where a destination row's data and scale/bias go.
inline unsigned char* data_of(const QuantOut& o, unsigned char* row) {
  return row + (is_int(o.kind) && !o.sb_last ? 4 : 0);
}
inline void put_scale_bias(const QuantOut& o, unsigned char* row, const RowParams& p) {
  unsigned char* sb = o.sb_last ? row + row_bytes(QKind(o.kind), o.cols) - 4 : row;
  std::memcpy(sb, &p.scale_h, 2);
  std::memcpy(sb + 2, &p.bias_h, 2);
}

// Rows [r0, r1) into every destination: the row's min/max once (for the INT-N ones), then
// each destination's scale/bias and data. One loop for both kernels: MinMax and Data are the
// scalar or AVX2 functions.
template <class MinMax, class Data>
void rows_with(MinMax minmax, Data data, const float* src, int64_t r0, int64_t r1, int64_t cols,
               int64_t stride, const QuantOut* outs, int64_t nouts) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = src + r * stride;
    float mn = 0, mx = 0;
    bool have = false;
    for (int64_t i = 0; i < nouts; ++i) {
      const QuantOut& o = outs[i];
      auto* row = reinterpret_cast<unsigned char*>(o.dst + r * o.dst_stride);
      RowParams p{};
      if (is_int(o.kind)) {
        if (!have) minmax(x, cols, &mn, &mx);
        have = true;
        p = params_of(mn, mx, int(o.kind));
        put_scale_bias(o, row, p);
      }
      data(x + o.col0, o, p, data_of(o, row));
    }
  }
}

void rows_scalar(const float* src, int64_t r0, int64_t r1, int64_t cols, int64_t stride,
                 const QuantOut* outs, int64_t nouts) {
  rows_with(minmax_scalar,
            [](const float* xs, const QuantOut& o, const RowParams& p, unsigned char* d) {
              data_scalar(xs, 0, o, p, d);
            },
            src, r0, r1, cols, stride, outs, nouts);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define MM_AVX2 __attribute__((target("avx2,f16c")))

MM_AVX2 void minmax_avx2(const float* x, int64_t n, float* mn, float* mx) {
  __m256 vmin = _mm256_set1_ps(FLT_MAX), vmax = _mm256_set1_ps(-FLT_MAX);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    vmin = _mm256_min_ps(vmin, v);
    vmax = _mm256_max_ps(vmax, v);
  }
  alignas(32) float bmin[8], bmax[8];
  _mm256_store_ps(bmin, vmin);
  _mm256_store_ps(bmax, vmax);
  float a = FLT_MAX, b = -FLT_MAX;
  for (int j = 0; j < 8; ++j) {
    a = std::min(a, bmin[j]);
    b = std::max(b, bmax[j]);
  }
  for (; c < n; ++c) {
    a = std::min(a, x[c]);
    b = std::max(b, x[c]);
  }
  *mn = a == 0.0f ? first_zero(x, n) : a;
  *mx = b;
}

// 32 quantized values of one row, as 32 bytes in element order.
MM_AVX2 inline __m256i q32_avx2(const float* s, __m256 vmin, __m256 vinv, __m256i vmaxq) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i q[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * k), vmin), vinv);
    q[k] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(t), zero), vmaxq);
  }
  // packs work per 128-bit lane: dwords come out as a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 ...
  const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]),
                                        _mm256_packus_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

MM_AVX2 void data_avx2(const float* xs, const QuantOut& o, const RowParams& p,
                       unsigned char* data) {
  int64_t c = 0;
  const int64_t kind = o.kind;
  if (kind == int64_t(QKind::kFp16)) {
    for (; c + 8 <= o.cols; c += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(data + 2 * c),
                       _mm256_cvtps_ph(_mm256_loadu_ps(xs + c), _MM_FROUND_TO_NEAREST_INT));
  } else if (is_int(kind)) {
    const __m256 vmin = _mm256_set1_ps(p.min), vinv = _mm256_set1_ps(p.inv);
    const __m256i vmaxq = _mm256_set1_epi32((1 << int(kind)) - 1);
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    const __m256i byte = _mm256_set1_epi32(0xFF);
    for (; c + 32 <= o.cols; c += 32) {
      const __m256i v = q32_avx2(xs + c, vmin, vinv, vmaxq);
      if (kind == 8) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(data + c), v);
      } else if (kind == 4) {  // bytes 2i, 2i+1 -> one byte: low nibble first
        const __m256i w = _mm256_or_si256(_mm256_and_si256(v, lo8),
                                          _mm256_slli_epi16(_mm256_srli_epi16(v, 8), 4));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(data + c / 2),
                         _mm_packus_epi16(_mm256_castsi256_si128(w),
                                          _mm256_extracti128_si256(w, 1)));
      } else {  // kind 2: bytes 4i..4i+3 -> one byte, 2 bits each, lowest first
        __m256i w = _mm256_and_si256(v, byte);
        w = _mm256_or_si256(w, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 8), byte), 2));
        w = _mm256_or_si256(w, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(v, 16), byte), 4));
        w = _mm256_or_si256(w, _mm256_slli_epi32(_mm256_srli_epi32(v, 24), 6));
        __m128i t = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        t = _mm_packus_epi16(t, t);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(data + c / 4), t);
      }
    }
  }
  data_scalar(xs, c, o, p, data);
}

void rows_avx2(const float* src, int64_t r0, int64_t r1, int64_t cols, int64_t stride,
               const QuantOut* outs, int64_t nouts) {
  rows_with(minmax_avx2, data_avx2, src, r0, r1, cols, stride, outs, nouts);
}
#undef MM_AVX2
#define MM_HAVE_AVX2 1
#endif

bool cpu_has_avx2() {
#if defined(MM_HAVE_AVX2)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

}  // namespace

int64_t row_bytes(QKind kind, int64_t cols) {
  switch (kind) {
    case QKind::kFp32: return 4 * cols;
    case QKind::kFp16: return 2 * cols;
    case QKind::kInt8: return cols + 4;
    case QKind::kInt4: return cols / 2 + 4;
    case QKind::kInt2: return cols / 4 + 4;
  }
  return -1;
}

const char* check_outputs(const QuantOut* outs, int64_t n, int64_t cols) {
  for (int64_t i = 0; i < n; ++i) {
    const QuantOut& o = outs[i];
    const int64_t k = o.kind;
    if (k != 2 && k != 4 && k != 8 && k != 16 && k != 32) return "unknown destination kind";
    if (o.col0 < 0 || o.cols <= 0 || o.col0 > cols || o.cols > cols - o.col0)
      return "destination columns outside the source row";
    if (is_int(k) && (o.cols % (8 / k) != 0 || o.col0 % (8 / k) != 0))
      return "INT4/INT2 destination columns must start and end on whole bytes";
    if (o.dst == 0) return "null destination";
    if (o.dst_stride < row_bytes(QKind(k), o.cols)) return "destination rows overlap";
  }
  return "";
}

const char* default_isa() { return cpu_has_avx2() ? "avx2" : "scalar"; }

void quantize_rows(const float* src, int64_t rows, int64_t cols, int64_t src_stride,
                   const QuantOut* outs, int64_t nouts, int threads, const char* isa) {
  MM_CHECK(rows >= 0 && cols > 0 && nouts >= 0, "bad row or column count");
  MM_CHECK(rows == 0 || nouts == 0 || (src != nullptr && outs != nullptr), "null pointer");
  MM_CHECK(rows <= 1 || src_stride >= cols, "source rows overlap");
  const char* bad = check_outputs(outs, nouts, cols);
  MM_CHECK(bad[0] == '\0', bad);
  const std::string want = isa == nullptr ? "" : isa;
  MM_CHECK(want.empty() || want == "avx2" || want == "scalar", "isa must be '', 'avx2' or 'scalar'");
  bool avx2 = want.empty() ? cpu_has_avx2() : want == "avx2";
  MM_CHECK(!avx2 || cpu_has_avx2(), "isa 'avx2' asked for on a CPU without AVX2/F16C");
  if (rows == 0 || nouts == 0) return;
  auto run = [=](int64_t r0, int64_t r1) {
    // Fresh destination pages (a storage born zero) fault in one call per range, not one
    // trap per page (measured here: 1.3-1.6 GB/s of fp32 rows into fresh pages, 2.5-3.4 into
    // mapped ones). Population maps zero pages; it never changes a byte.
    for (int64_t i = 0; i < nouts; ++i)
      prefault_bytes(reinterpret_cast<void*>(outs[i].dst + r0 * outs[i].dst_stride),
                     (r1 - r0) * outs[i].dst_stride);
#if defined(MM_HAVE_AVX2)
    if (avx2) return rows_avx2(src, r0, r1, cols, src_stride, outs, nouts);
#endif
    rows_scalar(src, r0, r1, cols, src_stride, outs, nouts);
  };
  // At least ~64 KiB of source per thread: below that a thread start costs more than it saves.
  const int64_t per_min = std::max<int64_t>(1, (int64_t(64) << 10) / (4 * cols));
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, (rows + per_min - 1) / per_min));
  const int64_t per = (rows + t - 1) / t;
  ThreadGroup group;
  std::vector<std::pair<int64_t, int64_t>> mine;  // shares no thread could start for
  for (int64_t k = 1; k < t; ++k) {
    const int64_t r0 = k * per, r1 = std::min(rows, r0 + per);
    if (r0 >= r1) break;
    if (!group.spawn([=] { run(r0, r1); })) mine.emplace_back(r0, r1);
  }
  run(0, std::min(rows, per));
  for (const auto& m : mine) run(m.first, m.second);
  group.join();
  if (group.error()) std::rethrow_exception(group.error());
}

}  // namespace quant
}  // namespace metamat
