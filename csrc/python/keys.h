// Philox keys of tables, as metamat/keys.py defines them: key = splitmix64(splitmix64(seed)
// ^ table_key(name)), table_key = BLAKE2b (RFC 7693, unkeyed, 8-byte digest) of the UTF-8
// name, read little-endian. The packer (bindings_pack.cpp) derives keys here, without a
// Python call per name; tests compare it with keys.py.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace metamat {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

namespace detail {

constexpr uint64_t kBlakeIV[8] = {0x6a09e667f3bcc908ull, 0xbb67ae8584caa73bull,
                                  0x3c6ef372fe94f82bull, 0xa54ff53a5f1d36f1ull,
                                  0x510e527fade682d1ull, 0x9b05688c2b3e6c1full,
                                  0x1f83d9abfb41bd6bull, 0x5be0cd19137e2179ull};
constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline void blake2b_compress(uint64_t h[8], const uint8_t block[128], uint64_t t, bool last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; ++i) {
    uint64_t w = 0;
    for (int b = 7; b >= 0; --b) w = (w << 8) | block[8 * i + b];
    m[i] = w;
  }
  for (int i = 0; i < 8; ++i) v[i] = h[i], v[i + 8] = kBlakeIV[i];
  v[12] ^= t;  // byte counter (names are far below 2^64 bytes)
  if (last) v[14] = ~v[14];
  auto g = [&](int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
  };
  for (int r = 0; r < 12; ++r) {
    const uint8_t* s = kSigma[r];
    g(0, 4, 8, 12, m[s[0]], m[s[1]]);
    g(1, 5, 9, 13, m[s[2]], m[s[3]]);
    g(2, 6, 10, 14, m[s[4]], m[s[5]]);
    g(3, 7, 11, 15, m[s[6]], m[s[7]]);
    g(0, 5, 10, 15, m[s[8]], m[s[9]]);
    g(1, 6, 11, 12, m[s[10]], m[s[11]]);
    g(2, 7, 8, 13, m[s[12]], m[s[13]]);
    g(3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

}  // namespace detail

// BLAKE2b-64 of `len` bytes, as a little-endian integer (hashlib.blake2b(digest_size=8)).
inline uint64_t table_key(const char* data, size_t len) {
  uint64_t h[8];
  std::memcpy(h, detail::kBlakeIV, sizeof(h));
  h[0] ^= 0x01010000ull ^ 8u;  // depth 1, fanout 1, no key, 8-byte digest
  uint8_t block[128];
  size_t off = 0;
  while (len - off > 128) {
    std::memcpy(block, data + off, 128);
    off += 128;
    detail::blake2b_compress(h, block, off, false);
  }
  std::memset(block, 0, 128);
  std::memcpy(block, data + off, len - off);
  detail::blake2b_compress(h, block, len, true);
  return h[0];  // the first 8 digest bytes, little-endian
}

inline uint64_t philox_key(uint64_t seed, const char* name, size_t len) {
  return splitmix64(splitmix64(seed) ^ table_key(name, len));
}

}  // namespace metamat
