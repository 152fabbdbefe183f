// Philox4x32-10 (philox.h) on kW consecutive counters at once, for every SIMD kernel (16, 8, 4 lanes).
//
// Two things make it cheaper than a lane-wise copy of the scalar rounds; neither changes a bit
// (tests compare every kernel with the NumPy reference):
// - Even/odd split: a counter's state lives in the low 32 bits of a 64-bit lane (vector E holds
//   counters 0, 2, 4, .., vector O holds 1, 3, 5, ..). _mm256_mul_epu32 then yields the full
//   64-bit product in place: hi = product >> 32, lo = the product itself (its upper half is
//   junk that no later step reads: multiplies read only the low 32 bits, xors act bitwise per
//   half, and the final regrouping keeps only low halves). No 32-bit mullo (10-cycle latency
//   on many CPUs), no blends inside the rounds, and E and O are two independent chains.
// - Rounds 1 to 3 are partly lane-uniform: words 1 and 2 of the counter are the row (same in
//   every lane) and word 3 is the high half of the column counter (same in a pass). Those
//   products are computed once per row on scalars (PhiloxRow), leaving one vector multiply in
//   each of the first two rounds instead of two.
#pragma once
#include "metamat/philox.h"
#include "simd_vec.h"

namespace metamat {
namespace MM_ISA {
namespace simd {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;

// Per table key: the ten round keys, as scalars and broadcast (made once per segment span).
struct PhiloxKey {
  uint32_t k0[10], k1[10];
  VI v0[10], v1[10];
  explicit PhiloxKey(uint64_t key) {
    k0[0] = static_cast<uint32_t>(key);
    k1[0] = static_cast<uint32_t>(key >> 32);
    for (int i = 1; i < 10; ++i) {
      k0[i] = k0[i - 1] + 0x9E3779B9u;
      k1[i] = k1[i - 1] + 0xBB67AE85u;
    }
    for (int i = 0; i < 10; ++i) {
      v0[i] = set1i(k0[i]);
      v1[i] = set1i(k1[i]);
    }
  }
};

// Per row: the lane-uniform values of rounds 1 to 3, folded with their round keys.
struct PhiloxRow {
  VI a1;  // round 2: new c0 = hi(M1 * c2) ^ a1
  VI b1;  // round 2: new c2 = c3 ^ b1
  VI d2;  // round 3: new c2 = hi(M0 * c0) ^ d2 (c3 is lane-uniform after round 2)
  PhiloxRow(const PhiloxKey& k, uint64_t row) {
    const uint32_t r_lo = static_cast<uint32_t>(row), r_hi = static_cast<uint32_t>(row >> 32);
    uint32_t hi, h0;
    const uint32_t lo1 = mulhilo(kPhiloxM1, r_hi, &hi);  // round 1 on c2 = r_hi
    const uint32_t s0 = hi ^ r_lo ^ k.k0[0];              // round 1: new c0 (c1 = r_lo)
    const uint32_t l0 = mulhilo(kPhiloxM0, s0, &h0);      // round 2 on c0 = s0
    a1 = set1i(lo1 ^ k.k0[1]);                            // round 2: c1 = lo1
    b1 = set1i(h0 ^ k.k1[1]);
    d2 = set1i(l0 ^ k.k1[2]);                             // round 2: new c3 = l0
  }
};

// The four words of counters {g_lo + j, g_hi}, j = 0 .. kW - 1, of one row, in counter order.
// g_lo + j must not carry: callers start at multiples of 16 and take at most 16 counters.
MM_SIMD void philox_lanes(const PhiloxKey& k, const PhiloxRow& pr, uint32_t g_lo,
                          uint32_t g_hi, VI out[4]) {
  const VI m0 = set1i(kPhiloxM0), m1 = set1i(kPhiloxM1);
  const VI g = iota(g_lo);  // lane 2j of E is counter 2j; O (= g >> 32) holds counter 2j + 1
  const VI a0 = set1i(g_hi ^ k.k1[0]);
  VI c0[2], c1[2], c2[2], c3[2];  // [0]: E, [1]: O
  for (int h = 0; h < 2; ++h) {
    // Round 1: c0 = counter (vector), c1 = r_lo, c2 = r_hi, c3 = g_hi (uniform).
    const VI p0 = mul_even(h ? srli64<32>(g) : g, m0);
    c2[h] = srli64<32>(p0) ^ a0;
    c3[h] = p0;
    // Round 2: c0, c1 uniform (folded into a1, b1), c2, c3 vectors.
    const VI p1 = mul_even(c2[h], m1);
    c0[h] = srli64<32>(p1) ^ pr.a1;
    c1[h] = p1;
    c2[h] = c3[h] ^ pr.b1;
    // Round 3: c3 = l0 is uniform (folded into d2).
    const VI q0 = mul_even(c0[h], m0), q1 = mul_even(c2[h], m1);
    c0[h] = srli64<32>(q1) ^ (c1[h] ^ k.v0[2]);
    c2[h] = srli64<32>(q0) ^ pr.d2;
    c1[h] = q1;
    c3[h] = q0;
  }
  for (int i = 3; i < 10; ++i) {
    for (int h = 0; h < 2; ++h) {
      const VI q0 = mul_even(c0[h], m0), q1 = mul_even(c2[h], m1);
      c0[h] = srli64<32>(q1) ^ (c1[h] ^ k.v0[i]);
      c2[h] = srli64<32>(q0) ^ (c3[h] ^ k.v1[i]);
      c1[h] = q1;
      c3[h] = q0;
    }
  }
  // Regroup: even counters from the low halves of E, odd ones from the low halves of O.
  out[0] = blend_odd(c0[0], slli64<32>(c0[1]));
  out[1] = blend_odd(c1[0], slli64<32>(c1[1]));
  out[2] = blend_odd(c2[0], slli64<32>(c2[1]));
  out[3] = blend_odd(c3[0], slli64<32>(c3[1]));
}

}  // namespace simd
}  // namespace MM_ISA
}  // namespace metamat
