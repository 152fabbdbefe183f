// XXH3-64 (seed 0, default secret), streaming, written from the published xxHash
// specification (doc/xxhash_spec.md of the xxHash project): the checksum manifests
// (metamat/checkpoint/checksum.py) hold one digest per 4 MiB block, and the reader hashes
// blocks as their bytes arrive, in pieces. Bit-exact with xxhash.xxh3_64_intdigest (tested for
// every length 0..4096, large lengths and arbitrary split points).
#pragma once
#include <cstddef>
#include <cstdint>

namespace metamat {

class Xxh3 {
 public:
  Xxh3() { reset(); }
  void reset();
  // Appends `len` bytes; any split of a message into update() calls gives the same digest.
  void update(const void* data, size_t len);
  // The digest of everything appended so far (the state is unchanged: more may follow).
  uint64_t digest() const;
  // One shot.
  static uint64_t hash(const void* data, size_t len);
  // The long-input loop in use: "avx2" or "scalar" (picked once per process from the CPU).
  static const char* kernel();
  // Tests: "scalar" forces the portable loop, "best" restores the CPU's pick. False if unknown.
  static bool set_kernel(const char* name);

 private:
  static constexpr size_t kBuf = 256;  // a multiple of the 64-byte stripe, >= 240
  void consume(const unsigned char* p, size_t stripes);
  alignas(32) uint64_t acc_[8];
  unsigned char buf_[kBuf];
  unsigned char last64_[64];  // the 64 input bytes just before buf_ (once stripes were consumed)
  size_t buffered_ = 0;
  uint64_t total_ = 0;
  int stripes_in_block_ = 0;
};

}  // namespace metamat
