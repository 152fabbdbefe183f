// libFuzzer harness for the C++ reader's op validation and execution (csrc/io/io_reader.cpp).
//
// The reader trusts the Python layer for destinations (it cannot see them) but must validate
// everything about the files: indices, offsets, sizes, strides, int64 overflow, dtypes. The
// harness therefore fuzzes every file-side field freely (full int64 range) and builds each
// destination itself: an exact-size heap buffer, so ASan flags any write outside it.
// Properties checked on every input:
//   * execute_reads never crashes, hangs or reads/writes out of bounds (ASan/UBSan);
//   * !ok && !wrote  =>  no destination byte changed;
//   * ok, raw copy   =>  destination rows equal the file bytes the op names;
//   * verified reads with the true digests never report a mismatch.
//
//   clang++ -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc/include -Icsrc \
//       fuzz/fuzz_read_ops.cpp csrc/io/*.cpp csrc/stage/*.cpp -o build/fuzz_read_ops
//   build/fuzz_read_ops -runs=100000
// Without clang: add -DMETAMAT_FUZZ_STANDALONE (g++), which runs N pseudo-random inputs.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "metamat/io_reader.h"
#include "metamat/xxh3.h"

namespace mio = metamat::io;

namespace {

struct Input {
  const uint8_t* p;
  size_t n;
  template <typename T>
  T take() {
    T v{};
    const size_t k = n < sizeof(T) ? n : sizeof(T);
    std::memcpy(&v, p, k);
    p += k;
    n -= k;
    return v;
  }
};

const std::string& data_file() {
  static std::string path = [] {
    char tmpl[] = "/tmp/metamat_fuzz_read_XXXXXX";
    const int fd = ::mkstemp(tmpl);
    if (fd < 0) std::abort();
    ::close(fd);
    return std::string(tmpl);
  }();
  return path;
}

uint8_t file_byte(int64_t i) { return uint8_t((i * 131 + 7) ^ (i >> 8)); }

// A raw field: usually a small value in range, sometimes anything (negatives, 2^63-1, ...).
int64_t field(Input& in, int64_t small_mod) {
  const uint8_t sel = in.take<uint8_t>();
  const int64_t raw = in.take<int64_t>();
  if (sel % 8 == 0) return raw;
  const int64_t m = raw % small_mod;
  return m < 0 ? -m : m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  // 1. the file: up to 64 KiB of a fixed pattern
  const int64_t flen = in.take<uint16_t>();
  {
    FILE* f = std::fopen(data_file().c_str(), "wb");
    if (f == nullptr) std::abort();
    std::vector<uint8_t> buf(static_cast<size_t>(flen));
    for (int64_t i = 0; i < flen; ++i) buf[size_t(i)] = file_byte(i);
    if (flen && std::fwrite(buf.data(), 1, buf.size(), f) != buf.size()) std::abort();
    std::fclose(f);
  }
  const std::vector<std::string> files = {data_file(), "/nonexistent/metamat_fuzz"};

  // 2. options
  mio::ReadOptions opt;
  opt.threads = 1 + in.take<uint8_t>() % 4;
  opt.task_bytes = field(in, 1 << 16);
  opt.bounce_bytes = field(in, 1 << 14);
  opt.coalesce_gap = int64_t(in.take<int16_t>());
  if (opt.coalesce_gap == -32768) opt.coalesce_gap = mio::kCoalesceAuto;  // the per-op rule
  opt.io = mio::IoMode(in.take<uint8_t>() % 3);  // buffered, direct, auto

  // 3. ops: file side fuzzed, destination built to fit exactly
  const int nops = in.take<uint8_t>() % 6;
  std::vector<mio::ReadOp> ops(static_cast<size_t>(nops));
  std::vector<std::vector<uint8_t>> dst(static_cast<size_t>(nops));
  for (int i = 0; i < nops; ++i) {
    mio::ReadOp& o = ops[size_t(i)];
    o.file_index = int64_t(in.take<int8_t>()) % 3;
    o.file_offset = field(in, 1 << 16);
    o.row_bytes = field(in, 1 << 12);
    o.rows = field(in, 40);
    o.src_stride = field(in, 1 << 13);
    const uint8_t dt = in.take<uint8_t>();
    o.src_dtype = int64_t(dt % 5) - (dt % 5 == 4 ? 5 : 0);  // 0..3 and -1
    o.dst_dtype = int64_t((dt / 5) % 4);
    if (dt >= 200) o.dst_dtype = o.src_dtype;
    // Destination footprint: rows of dst_row bytes at dst_stride; only buildable for sane
    // sizes (the Python layer never passes others: it owns the destination tensors).
    const int64_t ssz = metamat::dtype_size(metamat::DType(o.src_dtype));
    const int64_t dsz = metamat::dtype_size(metamat::DType(o.dst_dtype));
    const bool conv = o.src_dtype != o.dst_dtype;
    if (o.rows < 0 || o.rows > 64 || o.row_bytes < 0 || o.row_bytes > (1 << 16)) {
      o.dst = 0x1000;  // never dereferenced: such ops must fail validation or be empty
      o.dst_stride = 0;
      if (o.rows > 0 && o.row_bytes > 0 && o.rows <= (int64_t(1) << 40) &&
          o.row_bytes <= (int64_t(1) << 40)) {
        // a big but non-negative op: the file range check must refuse it (file <= 64 KiB)
        if (o.file_index == 0 && o.rows == 1 && o.file_offset >= 0 &&
            o.file_offset + o.row_bytes <= flen)
          o.rows = 0;  // would be legal: make it empty instead
      }
      continue;
    }
    int64_t dst_row = o.row_bytes;
    if (conv && ssz > 0 && dsz > 0) dst_row = o.row_bytes / ssz * dsz;
    o.dst_stride = dst_row + (in.take<uint8_t>() % 16);
    const int64_t need = o.rows == 0 ? 0 : (o.rows - 1) * o.dst_stride + dst_row;
    dst[size_t(i)].assign(size_t(need), 0xA5);
    o.dst = need ? int64_t(reinterpret_cast<uintptr_t>(dst[size_t(i)].data())) : 0x1000;
  }

  // 4. verify blocks, sometimes: none (plain read), blocks of a fuzzed size covering file 0
  //    with the true digests (must verify), or fuzzed blocks (must be refused or mismatch
  //    cleanly, never crash or write outside the destinations).
  std::vector<mio::VerifyBlock> blocks;
  const uint8_t vsel = in.take<uint8_t>() % 4;
  int64_t nblocks = -1;
  if (vsel == 1 && flen > 0) {
    const int64_t bs = 1 + (field(in, 1 << 14) & ((1 << 14) - 1));  // 1..16384
    std::vector<uint8_t> bytes(static_cast<size_t>(flen));
    for (int64_t i = 0; i < flen; ++i) bytes[size_t(i)] = file_byte(i);
    for (int64_t off = 0; off < flen; off += bs) {
      const int64_t len = std::min<int64_t>(bs, flen - off);
      blocks.push_back({0, off, len, metamat::Xxh3::hash(bytes.data() + off, size_t(len))});
    }
    nblocks = int64_t(blocks.size());
  } else if (vsel >= 2) {
    const int nb = in.take<uint8_t>() % 8;
    for (int k = 0; k < nb; ++k) {
      mio::VerifyBlock b;
      b.file_index = int64_t(in.take<int8_t>()) % 3;
      b.offset = field(in, 1 << 16);
      b.length = field(in, 1 << 15);
      b.digest = in.take<uint64_t>();
      blocks.push_back(b);
    }
    nblocks = int64_t(blocks.size());
  }

  const mio::ReadResult r =
      mio::execute_reads(files, ops.data(), nops, opt, blocks.data(), nblocks);

  // 4. properties
  if (!r.ok && !r.wrote) {
    for (const auto& d : dst)
      for (uint8_t b : d)
        if (b != 0xA5) {
          std::fprintf(stderr, "validation failed after a write: %s\n", r.error.c_str());
          std::abort();
        }
  }
  if (r.mismatch && vsel == 1) {
    std::fprintf(stderr, "true digests reported a mismatch: %s\n", r.error.c_str());
    std::abort();
  }
  if (r.ok) {
    for (int i = 0; i < nops; ++i) {
      const mio::ReadOp& o = ops[size_t(i)];
      if (o.src_dtype != o.dst_dtype || dst[size_t(i)].empty() || o.row_bytes == 0) continue;
      for (int64_t row = 0; row < o.rows; ++row)
        for (int64_t b = 0; b < o.row_bytes; ++b) {
          const uint8_t got = dst[size_t(i)][size_t(row * o.dst_stride + b)];
          if (got != file_byte(o.file_offset + row * o.src_stride + b)) {
            std::fprintf(stderr, "op %d row %lld byte %lld wrong\n", i, (long long)row,
                         (long long)b);
            std::abort();
          }
        }
    }
  }
  return 0;
}

#ifdef METAMAT_FUZZ_STANDALONE
// g++ fallback: N pseudo-random inputs (no coverage guidance).
int main(int argc, char** argv) {
  const long runs = argc > 1 ? std::atol(argv[1]) : 20000;
  uint64_t s = 0x9E3779B97F4A7C15ull;
  std::vector<uint8_t> buf;
  for (long i = 0; i < runs; ++i) {
    buf.resize(16 + (s >> 58) * 8);
    for (auto& b : buf) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      b = uint8_t(s);
    }
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  std::printf("Done %ld runs\n", runs);
  ::unlink(data_file().c_str());
  return 0;
}
#endif
