// Thread-sanitizer stress of the reader crew (metamat/io_reader.h ReadCrew): many calls on one
// crew (thread count, task size and I/O mode per crew; op shapes, verified reads and injected
// read failures per call), every result checked against the file's bytes; then staging
// pipelines on two threads at once (the shared staging-buffer cache). Built and run
// by tests/test_reader_tasks.py with g++ -fsanitize=thread (data races, lock-order problems,
// a helper joining a finished call) and by hand:
//
//   g++ -std=c++17 -g -O1 -fsanitize=thread -Icsrc/include -Icsrc fuzz/stress_read_crew.cpp \
//       csrc/io/*.cpp csrc/stage/*.cpp -o build/stress_read_crew -lpthread
//   build/stress_read_crew 300
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <thread>
#include <atomic>
#include <string>
#include <vector>

#include "metamat/io_reader.h"
#include "metamat/stage.h"
#include "metamat/xxh3.h"

namespace mio = metamat::io;

int main(int argc, char** argv) {
  const int calls = argc > 1 ? std::atoi(argv[1]) : 200;
  const int64_t size = int64_t(6) << 20;
  char path[] = "/tmp/metamat-crew-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return 2;
  std::vector<unsigned char> body(size_t(size), 0);
  std::mt19937_64 rng(7);
  for (auto& b : body) b = static_cast<unsigned char>(rng());
  if (write(fd, body.data(), body.size()) != ssize_t(body.size())) return 2;
  close(fd);
  const std::vector<std::string> files{path};
  // Verified calls use the file's 1 MiB blocks with their true digests.
  std::vector<mio::VerifyBlock> blocks;
  for (int64_t off = 0; off < size; off += int64_t(1) << 20) {
    const int64_t len = std::min<int64_t>(int64_t(1) << 20, size - off);
    blocks.push_back({0, off, len, metamat::Xxh3::hash(body.data() + off, size_t(len))});
  }
  int failures = 0;
  for (int round = 0; round < 4 && failures == 0; ++round) {
    mio::ReadOptions opt;
    opt.threads = 2 + round % 3;
    opt.task_bytes = round % 2 ? (int64_t(64) << 10) : (int64_t(8) << 20);
    opt.bounce_bytes = int64_t(64) << 10;
    opt.io = round == 3 ? mio::IoMode::kDirect : mio::IoMode::kBuffered;
    mio::ReadCrew crew(files, opt);
    for (int c = 0; c < calls && failures == 0; ++c) {
      // 1-6 ops: contiguous spans and strided rows at random offsets
      const int nops = 1 + int(rng() % 6);
      std::vector<mio::ReadOp> ops{static_cast<size_t>(nops), mio::ReadOp{}};
      std::vector<std::vector<unsigned char>> dst{static_cast<size_t>(nops), std::vector<unsigned char>()};
      for (int i = 0; i < nops; ++i) {
        mio::ReadOp& o = ops[size_t(i)];
        const bool strided = rng() % 3 == 0;
        o.file_index = 0;
        o.rows = strided ? 1 + int64_t(rng() % 64) : 1;
        o.row_bytes = strided ? 1 + int64_t(rng() % 4096) : 1 + int64_t(rng() % (3 << 20));
        o.src_stride = strided ? o.row_bytes + int64_t(rng() % 8192) : o.row_bytes;
        const int64_t span = (o.rows - 1) * o.src_stride + o.row_bytes;
        o.file_offset = int64_t(rng() % uint64_t(size - span + 1));
        o.dst_stride = o.row_bytes;
        o.src_dtype = o.dst_dtype = 0;
        dst[size_t(i)].assign(size_t(o.rows * o.row_bytes), 0xA5);
        o.dst = int64_t(reinterpret_cast<uintptr_t>(dst[size_t(i)].data()));
      }
      const bool fault = c % 7 == 3;
      if (fault) setenv("METAMAT_IO_FAULT", "2:eio", 1); else unsetenv("METAMAT_IO_FAULT");
      const bool verify = c % 5 == 1;
      const mio::ReadResult r = verify ? crew.run(ops.data(), nops, blocks.data(),
                                                  int64_t(blocks.size()))
                                       : crew.run(ops.data(), nops);
      if (verify && r.mismatch) {
        std::fprintf(stderr, "call %d: true digests reported as a mismatch\n", c);
        ++failures;
      }
      if (!r.ok) {
        if (!fault) {
          std::fprintf(stderr, "call %d failed: %s\n", c, r.error.c_str());
          ++failures;
        }
        continue;
      }
      for (int i = 0; i < nops && failures == 0; ++i) {
        const mio::ReadOp& o = ops[size_t(i)];
        for (int64_t row = 0; row < o.rows; ++row)
          if (std::memcmp(dst[size_t(i)].data() + row * o.row_bytes,
                          body.data() + o.file_offset + row * o.src_stride,
                          size_t(o.row_bytes)) != 0) {
            std::fprintf(stderr, "call %d op %d row %lld differs\n", c, i, (long long)row);
            ++failures;
            break;
          }
      }
    }
  }
  // Staging pipelines on two threads at once: rings taken from and given back to the shared
  // staging-buffer cache (stage_pool.h) concurrently, host sinks, bytes checked.
  std::atomic<int> bad{0};
  const int64_t started0 = mio::reader_threads_started();
  auto pipelines = [&](int seed) {
    std::mt19937_64 r2{static_cast<uint64_t>(seed)};
    for (int k = 0; k < 20; ++k) {
      // runs of one pipeline share its crew (until close); copies are checked after close()
      std::vector<std::vector<unsigned char>> outs(3);  // outlive the pipeline
      int64_t offs[3];
      bool ok = true;
      mio::StagePipeline pipe(1 + int(r2() % 3), (int64_t(64) << 10) << (r2() % 4),
                              {mio::SinkSpec{}});
      for (int j = 0; j < 3; ++j) {
        const int64_t n = 1 + int64_t(r2() % (2 << 20));
        offs[j] = int64_t(r2() % uint64_t(size - n));
        outs[size_t(j)].assign(size_t(n), 0xA5);
        mio::ReadOp o{0, offs[j], n, 1, n, n,
                      int64_t(reinterpret_cast<uintptr_t>(outs[size_t(j)].data())), 0, 0};
        const int64_t sink = 0;
        mio::ReadOptions po;
        po.threads = 2 + j / 2;  // the third run changes options: a new crew
        po.task_bytes = int64_t(16) << 10;  // chunks of 64-512 KiB: several tasks, helpers
        po.io = k % 4 == 3 ? mio::IoMode::kDirect : mio::IoMode::kBuffered;
        ok = pipe.run(files, &o, &sink, 1, po, nullptr, -1, nullptr).ok && ok;
      }
      pipe.close();
      for (int j = 0; j < 3; ++j)
        ok = ok && std::memcmp(outs[size_t(j)].data(), body.data() + offs[j],
                               outs[size_t(j)].size()) == 0;
      if (!ok) ++bad;
    }
  };
  if (failures == 0) {
    unsetenv("METAMAT_IO_FAULT");
    std::thread a(pipelines, 1), b(pipelines, 2);
    a.join();
    b.join();
    if (bad.load() != 0) {
      std::fprintf(stderr, "%d staged loads differ\n", bad.load());
      ++failures;
    }
    // a crew kept per pipeline starts at most 1 helper for runs 0-1 and 2 for run 2 (one crew
    // per run could start 4); and helpers did run
    const int64_t helpers = mio::reader_threads_started() - started0;
    if (helpers <= 0 || helpers > 40 * 3) {
      std::fprintf(stderr, "pipelines started %lld helper threads\n",
                   static_cast<long long>(helpers));
      ++failures;
    }
  }
  unlink(path);
  if (failures == 0)
    std::printf("crew stress: %d calls x 4 crews ok; 40 pipelines x 3 runs on 2 threads ok (%lld ring "
                "buffers from the cache)\n", calls,
                static_cast<long long>(mio::stage_pool_stats().hits));
  return failures == 0 ? 0 : 1;
}
