// XXH3-64, seed 0, default secret. See xxh3.h. Short inputs (0, 1-3, 4-8, 9-16, 17-128,
// 129-240 bytes) hash in one step; longer ones run the stripe/accumulate/scramble loop over
// 1024-byte blocks (16 stripes of 64 bytes), then the last stripe and the final merge.
#include "metamat/xxh3.h"

#include <immintrin.h>

#include <atomic>
#include <cstring>
#include <string>

namespace metamat {

namespace {

constexpr uint64_t kP32_1 = 0x9E3779B1u, kP32_2 = 0x85EBCA77u, kP32_3 = 0xC2B2AE3Du;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull, kP64_2 = 0xC2B2AE3D27D4EB4Full,
                   kP64_3 = 0x165667B19E3779F9ull, kP64_4 = 0x85EBCA77C2B2AE63ull,
                   kP64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t kMx1 = 0x165667919E3779F9ull, kMx2 = 0x9FB21C651E98DF25ull;

constexpr size_t kSecretSize = 192;
constexpr size_t kStripe = 64, kStripesPerBlock = (kSecretSize - 64) / 8;  // 16
constexpr size_t kBlock = kStripe * kStripesPerBlock;                       // 1024

alignas(64) const unsigned char kSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

// Little-endian reads (x86-64; the project builds for little-endian hosts only).
inline uint64_t r64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint32_t r32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t fold128(uint64_t a, uint64_t b) {
  const __uint128_t p = static_cast<__uint128_t>(a) * b;
  return uint64_t(p) ^ uint64_t(p >> 64);
}

inline uint64_t avalanche(uint64_t x) {
  x ^= x >> 37;
  x *= kMx1;
  return x ^ (x >> 32);
}

inline uint64_t avalanche_xxh64(uint64_t x) {
  x ^= x >> 33;
  x *= kP64_2;
  x ^= x >> 29;
  x *= kP64_3;
  return x ^ (x >> 32);
}

// 16 input bytes with 16 secret bytes (seed 0).
inline uint64_t mix16(const unsigned char* in, const unsigned char* sec) {
  return fold128(r64(in) ^ r64(sec), r64(in + 8) ^ r64(sec + 8));
}

uint64_t hash_0to16(const unsigned char* in, size_t len) {
  const unsigned char* s = kSecret;
  if (len > 8) {
    const uint64_t lo = r64(in) ^ (r64(s + 24) ^ r64(s + 32));
    const uint64_t hi = r64(in + len - 8) ^ (r64(s + 40) ^ r64(s + 48));
    return avalanche(len + __builtin_bswap64(lo) + hi + fold128(lo, hi));
  }
  if (len >= 4) {
    const uint64_t first = r32(in), last = r32(in + len - 4);
    uint64_t h = (last | (first << 32)) ^ (r64(s + 8) ^ r64(s + 16));
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= kMx2;
    h ^= (h >> 35) + len;
    h *= kMx2;
    return h ^ (h >> 28);
  }
  if (len > 0) {
    const uint32_t combined = uint32_t(in[len - 1]) | (uint32_t(len) << 8) |
                              (uint32_t(in[0]) << 16) | (uint32_t(in[len >> 1]) << 24);
    return avalanche_xxh64(uint64_t(r32(s) ^ r32(s + 4)) ^ combined);
  }
  return avalanche_xxh64(r64(s + 56) ^ r64(s + 64));
}

uint64_t hash_17to128(const unsigned char* in, size_t len) {
  uint64_t acc = len * kP64_1;
  const size_t rounds = ((len - 1) >> 5) + 1;
  for (size_t i = rounds; i-- > 0;) {
    acc += mix16(in + 16 * i, kSecret + 32 * i);
    acc += mix16(in + len - 16 * i - 16, kSecret + 32 * i + 16);
  }
  return avalanche(acc);
}

uint64_t hash_129to240(const unsigned char* in, size_t len) {
  uint64_t acc = len * kP64_1;
  const size_t chunks = len >> 4;
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, kSecret + 16 * i);
  acc = avalanche(acc);
  for (size_t i = 8; i < chunks; ++i) acc += mix16(in + 16 * i, kSecret + 16 * (i - 8) + 3);
  acc += mix16(in + len - 16, kSecret + 119);
  return avalanche(acc);
}

// ---- the long loop ----

inline void accumulate(uint64_t* acc, const unsigned char* in, const unsigned char* sec) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t v = r64(in + 8 * i);
    const uint64_t k = v ^ r64(sec + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
  }
}

inline void scramble(uint64_t* acc) {
  const unsigned char* sec = kSecret + kSecretSize - 64;
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= r64(sec + 8 * i);
    acc[i] = a * kP32_1;
  }
}

void blocks_scalar(uint64_t* acc, const unsigned char* p, size_t nblocks) {
  for (size_t b = 0; b < nblocks; ++b, p += kBlock) {
    for (size_t s = 0; s < kStripesPerBlock; ++s) accumulate(acc, p + s * kStripe, kSecret + 8 * s);
    scramble(acc);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void blocks_avx2(uint64_t* acc, const unsigned char* p,
                                                  size_t nblocks) {
  __m256i a[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4))};
  const __m256i prime = _mm256_set1_epi32(int(kP32_1));
  for (size_t b = 0; b < nblocks; ++b, p += kBlock) {
    for (size_t s = 0; s < kStripesPerBlock; ++s) {
      _mm_prefetch(reinterpret_cast<const char*>(p + s * kStripe + 384), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + s * kStripe + 32 * h));
        const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kSecret + 8 * s + 32 * h));
        const __m256i dk = _mm256_xor_si256(d, k);
        const __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));  // lo * hi
        const __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));  // lane i^1
        a[h] = _mm256_add_epi64(a[h], _mm256_add_epi64(prod, swapped));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i k = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(kSecret + kSecretSize - 64 + 32 * h));
      __m256i x = _mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47));
      x = _mm256_xor_si256(x, k);
      // x * P32_1 (64-bit by 32-bit): lo*P + (hi*P << 32)
      const __m256i lo = _mm256_mul_epu32(x, prime);
      const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
      a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a[1]);
}
#endif

using BlocksFn = void (*)(uint64_t*, const unsigned char*, size_t);

BlocksFn pick_blocks() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return blocks_avx2;
#endif
  return blocks_scalar;
}

std::atomic<BlocksFn> g_blocks{pick_blocks()};

uint64_t merge(const uint64_t* acc, uint64_t total) {
  uint64_t r = total * kP64_1;
  for (int i = 0; i < 4; ++i)
    r += fold128(acc[2 * i] ^ r64(kSecret + 11 + 16 * i), acc[2 * i + 1] ^ r64(kSecret + 19 + 16 * i));
  return avalanche(r);
}

}  // namespace

const char* Xxh3::kernel() { return g_blocks.load() == blocks_scalar ? "scalar" : "avx2"; }

bool Xxh3::set_kernel(const char* name) {
  const std::string n(name);
  if (n == "scalar") g_blocks = blocks_scalar;
  else if (n == "best") g_blocks = pick_blocks();
  else return false;
  return true;
}

void Xxh3::reset() {
  const uint64_t init[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  std::memcpy(acc_, init, sizeof(acc_));
  buffered_ = 0;
  total_ = 0;
  stripes_in_block_ = 0;
}

// Accumulates `stripes` full stripes that are known not to be the input's last bytes (a
// stripe is consumed only once more input follows it: the final stripe is special).
void Xxh3::consume(const unsigned char* p, size_t stripes) {
  while (stripes > 0) {
    if (stripes_in_block_ == 0 && stripes >= kStripesPerBlock) {
      const size_t nb = stripes / kStripesPerBlock;
      g_blocks.load(std::memory_order_relaxed)(acc_, p, nb);
      p += nb * kBlock;
      stripes -= nb * kStripesPerBlock;
      continue;
    }
    accumulate(acc_, p, kSecret + 8 * stripes_in_block_);
    p += kStripe;
    --stripes;
    if (++stripes_in_block_ == int(kStripesPerBlock)) {
      scramble(acc_);
      stripes_in_block_ = 0;
    }
  }
}

void Xxh3::update(const void* data, size_t len) {
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += len;
  if (buffered_ + len <= kBuf) {  // keep at least the last byte: its stripe may be the last
    if (len) std::memcpy(buf_ + buffered_, p, len);
    buffered_ += len;
    return;
  }
  if (buffered_ > 0) {  // complete the buffer; more input follows, so all of it is consumed
    const size_t fill = kBuf - buffered_;
    std::memcpy(buf_ + buffered_, p, fill);
    p += fill;
    len -= fill;
    consume(buf_, kBuf / kStripe);
    std::memcpy(last64_, buf_ + kBuf - 64, 64);
    buffered_ = 0;
  }
  if (len > kBuf) {  // straight from the input, leaving 1..64 bytes
    const size_t n = (len - 1) / kStripe;
    consume(p, n);
    std::memcpy(last64_, p + n * kStripe - 64, 64);
    p += n * kStripe;
    len -= n * kStripe;
  }
  std::memcpy(buf_, p, len);
  buffered_ = len;
}

uint64_t Xxh3::digest() const {
  if (total_ <= 240) {  // nothing consumed yet: the whole input is in buf_
    if (total_ <= 16) return hash_0to16(buf_, size_t(total_));
    if (total_ <= 128) return hash_17to128(buf_, size_t(total_));
    return hash_129to240(buf_, size_t(total_));
  }
  Xxh3 s = *this;  // the stripes still buffered, then the last stripe, on a copy
  const size_t r = buffered_;  // 1..kBuf
  s.consume(buf_, (r - 1) / kStripe);
  unsigned char last[64];
  if (r >= 64) {
    std::memcpy(last, buf_ + r - 64, 64);
  } else {
    std::memcpy(last, last64_ + r, 64 - r);
    std::memcpy(last + 64 - r, buf_, r);
  }
  accumulate(s.acc_, last, kSecret + kSecretSize - 64 - 7);
  return merge(s.acc_, total_);
}

uint64_t Xxh3::hash(const void* data, size_t len) {
  Xxh3 s;
  s.update(data, len);
  return s.digest();
}

}  // namespace metamat
