// pybind11 bindings of the checkpoint reader (io_reader.h): argument plumbing, GIL release.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <optional>
#include <stdexcept>

#include "io/io_direct.h"
#include "metamat/io_file.h"
#include "metamat/io_reader.h"
#include "metamat/stage.h"
#include "metamat/xxh3.h"
#include "dicts.h"

#include <unistd.h>

namespace py = pybind11;

namespace {

namespace mio = metamat::io;
using Identities = std::vector<std::array<int64_t, 4>>;

mio::IoMode parse_io(const std::string& io) {
  if (io == "buffered") return mio::IoMode::kBuffered;
  if (io == "direct") return mio::IoMode::kDirect;
  if (io == "auto") return mio::IoMode::kAuto;
  throw py::value_error("io must be 'buffered', 'direct' or 'auto', not '" + io + "'");
}

mio::ReadOptions options(int threads, int64_t task_bytes, int64_t bounce_bytes,
                         std::optional<int64_t> coalesce_gap, const Identities& identities,
                         int64_t max_open_files, const std::string& io,
                         int64_t auto_direct_min) {
  mio::ReadOptions opt;
  opt.threads = threads;
  opt.task_bytes = task_bytes;
  opt.bounce_bytes = bounce_bytes;
  opt.coalesce_gap = coalesce_gap ? *coalesce_gap : mio::kCoalesceAuto;
  opt.max_open_files = max_open_files;
  opt.io = parse_io(io);
  opt.auto_direct_min = auto_direct_min;
  for (const auto& id : identities) opt.identities.push_back({id[0], id[1], id[2], id[3]});
  return opt;
}

const char* mode_name(const mio::FileReport& f) {
  if (f.bytes_direct > 0 && f.bytes_buffered > 0) return "mixed";
  if (f.bytes_direct > 0) return "direct";
  if (f.bytes_buffered > 0) return "buffered";
  return "unused";
}

py::dict report(const mio::ReadResult& r) {
  py::list per_file;
  using F = mio::FileReport;
  for (const F& f : r.files) {
    py::dict d = metamat_py::as_dict(f, MM_FIELD(F, bytes_buffered), MM_FIELD(F, bytes_direct),
                                     MM_FIELD(F, direct_refused), MM_FIELD(F, refuse_reason));
    d["mode"] = mode_name(f);
    per_file.append(d);
  }
  using R = mio::ReadResult;
  py::dict out = metamat_py::as_dict(r, MM_FIELD(R, ok), MM_FIELD(R, error),
                                     MM_FIELD(R, failed_op), MM_FIELD(R, wrote),
                                     MM_FIELD(R, bytes_read), MM_FIELD(R, bytes_hashed),
                                     MM_FIELD(R, bytes_reread), MM_FIELD(R, tasks),
                                     MM_FIELD(R, threads));
  out["files"] = per_file;
  if (r.mismatch) {
    py::dict mm;  // named for Python, not as the struct's mismatch_* fields
    mm["file_index"] = r.mismatch_file;
    mm["offset"] = r.mismatch_offset;
    mm["length"] = r.mismatch_length;
    mm["expected"] = r.mismatch_expected;
    mm["got"] = r.mismatch_got;
    out["mismatch"] = mm;
  } else {
    out["mismatch"] = py::none();
  }
  return out;
}

}  // namespace

void metamat_bind_io(py::module_& m) {
  m.attr("READ_OP_FIELDS") = 9;
  m.def(
      "read_ops",
      [](const std::vector<std::string>& files, uintptr_t ops_addr, int64_t count, int threads,
         int64_t task_bytes, int64_t bounce_bytes, std::optional<int64_t> coalesce_gap,
         const Identities& identities, int64_t max_open_files, const std::string& io) {
        const mio::ReadOptions opt = options(threads, task_bytes, bounce_bytes, coalesce_gap,
                                             identities, max_open_files, io, int64_t(1) << 20);
        mio::ReadResult r;
        {
          py::gil_scoped_release nogil;
          r = mio::execute_reads(files, reinterpret_cast<const mio::ReadOp*>(ops_addr), count,
                                 opt);
        }
        return py::make_tuple(r.ok, r.error, r.failed_op, r.bytes_read, r.wrote);
      },
      py::arg("files"), py::arg("ops_addr"), py::arg("count"), py::arg("threads"),
      py::arg("task_bytes") = int64_t(8) << 20, py::arg("bounce_bytes") = int64_t(8) << 20,
      py::arg("coalesce_gap") = 4096, py::kw_only(), py::arg("identities") = Identities(),
      py::arg("max_open_files") = 0, py::arg("io") = "buffered",
      "Execute `count` packed ReadOps (9 int64 each: file_index, file_offset, row_bytes, rows,\n"
      "src_stride, dst_stride, dst, src_dtype, dst_dtype) at `ops_addr`.\n"
      "identities: [] or one (st_dev, st_ino, st_size, st_mtime_ns) per file (-1: unchecked);\n"
      "a file whose fstat differs is refused before anything is written.\n"
      "max_open_files: descriptor cache size (<= 0: max(16, RLIMIT_NOFILE / 4)).\n"
      "io: 'buffered', 'direct' or 'auto' (see read_plan). coalesce_gap None: the reader's\n"
      "per-op rule (read_plan's default); an int: that threshold (< 0: never coalesce).\n"
      "Returns (ok, error, failed_op, bytes_read, wrote).");
  m.def(
      "read_plan",
      [](const std::vector<std::string>& files, uintptr_t ops_addr, int64_t count, int threads,
         int64_t task_bytes, int64_t bounce_bytes, std::optional<int64_t> coalesce_gap,
         const Identities& identities, int64_t max_open_files, const std::string& io,
         int64_t auto_direct_min, uintptr_t verify_addr, int64_t verify_count) {
        const mio::ReadOptions opt = options(threads, task_bytes, bounce_bytes, coalesce_gap,
                                             identities, max_open_files, io, auto_direct_min);
        mio::ReadResult r;
        {
          py::gil_scoped_release nogil;
          r = mio::execute_reads(files, reinterpret_cast<const mio::ReadOp*>(ops_addr), count,
                                 opt, reinterpret_cast<const mio::VerifyBlock*>(verify_addr),
                                 verify_count);
        }
        return report(r);
      },
      py::arg("files"), py::arg("ops_addr"), py::arg("count"), py::kw_only(),
      py::arg("threads") = 4, py::arg("task_bytes") = int64_t(8) << 20,
      py::arg("bounce_bytes") = int64_t(8) << 20, py::arg("coalesce_gap") = py::none(),
      py::arg("identities") = Identities(), py::arg("max_open_files") = 0,
      py::arg("io") = "buffered", py::arg("auto_direct_min") = int64_t(1) << 20,
      py::arg("verify_addr") = 0, py::arg("verify_count") = -1,
      "read_ops with every option and a full report (dict): ok, error, failed_op, wrote,\n"
      "(coalesce_gap defaults to None here: the reader's measured per-op rule)\n"
      "bytes_read, files (per file: mode 'buffered'|'direct'|'mixed'|'unused', bytes_buffered,\n"
      "bytes_direct, direct_refused, refuse_reason), bytes_hashed, bytes_reread, mismatch.\n"
      "verify_count >= 0: verified read against `verify_count` blocks at `verify_addr` (4 int64\n"
      "each: file_index, offset, length, xxh3_64 digest bits); mismatch is None or a dict\n"
      "(file_index, offset, length, expected, got) for the first block that differed.");
  py::class_<mio::StagePipeline>(m, "StagePipeline",
      "The staging pipeline (metamat/stage.h): a ring of host buffers (page-locked when a sink\n"
      "is CUDA) read into by the reader and copied out by one sink per destination device.\n"
      "Use close() (metamat/load/staged.py does, on every path); the destructor also releases.")
      .def(py::init([](int ring, int64_t buffer_bytes, const std::vector<py::dict>& sinks) {
             std::vector<mio::SinkSpec> specs;
             for (const py::dict& d : sinks) {
               mio::SinkSpec s;
               const std::string kind = d.contains("kind") ? py::cast<std::string>(d["kind"]) : "host";
               if (kind == "cuda") s.kind = mio::SinkSpec::kCuda;
               else if (kind == "host") s.kind = mio::SinkSpec::kHost;
               else throw py::value_error("sink kind must be 'host' or 'cuda', not '" + kind + "'");
               if (d.contains("device")) s.device = py::cast<int>(d["device"]);
               if (d.contains("stream")) s.stream = py::cast<uintptr_t>(d["stream"]);
               if (d.contains("delay_us")) s.delay_us = py::cast<int64_t>(d["delay_us"]);
               if (d.contains("fail_copy_at")) s.fail_copy_at = py::cast<int64_t>(d["fail_copy_at"]);
               specs.push_back(s);
             }
             py::gil_scoped_release nogil;
             return new mio::StagePipeline(ring, buffer_bytes, specs);
           }),
           py::arg("ring"), py::arg("buffer_bytes"), py::arg("sinks"),
           "sinks: one dict per destination device: {'kind': 'cuda', 'device': i, 'stream':\n"
           "torch.cuda.current_stream(i).cuda_stream} or {'kind': 'host'} (memcpy on a sink\n"
           "thread; tests: 'delay_us' per copy, 'fail_copy_at' n-th copy throws).")
      .def(
          "run",
          [](mio::StagePipeline& self, const std::vector<std::string>& files, uintptr_t ops_addr,
             uintptr_t sinks_addr, int64_t count, int threads, int64_t task_bytes,
             int64_t bounce_bytes, std::optional<int64_t> coalesce_gap,
             const Identities& identities, int64_t max_open_files, const std::string& io,
             int64_t auto_direct_min, uintptr_t verify_addr, int64_t verify_count) {
            const mio::ReadOptions opt = options(threads, task_bytes, bounce_bytes, coalesce_gap,
                                                 identities, max_open_files, io, auto_direct_min);
            mio::ReadResult r;
            mio::StageReport rep;
            {
              py::gil_scoped_release nogil;
              r = self.run(files, reinterpret_cast<const mio::ReadOp*>(ops_addr),
                           reinterpret_cast<const int64_t*>(sinks_addr), count, opt,
                           reinterpret_cast<const mio::VerifyBlock*>(verify_addr), verify_count,
                           &rep);
            }
            py::dict out = report(r);
            out["chunks"] = rep.chunks;
            out["pieces"] = rep.pieces;
            out["wait_seconds"] = rep.wait_seconds;
            out["read_seconds"] = rep.read_seconds;
            out["queue_seconds"] = rep.queue_seconds;
            return out;
          },
          py::arg("files"), py::arg("ops_addr"), py::arg("sinks_addr"), py::arg("count"),
          py::kw_only(), py::arg("threads") = 4, py::arg("task_bytes") = int64_t(8) << 20,
          py::arg("bounce_bytes") = int64_t(8) << 20, py::arg("coalesce_gap") = py::none(),
          py::arg("identities") = Identities(), py::arg("max_open_files") = 0,
          py::arg("io") = "buffered", py::arg("auto_direct_min") = int64_t(1) << 20,
          py::arg("verify_addr") = 0, py::arg("verify_count") = -1,
          "Stage `count` packed ReadOps (destinations: where each op's sink writes) whose sink\n"
          "indices are `count` int64 at `sinks_addr`. Options and result as read_plan, plus\n"
          "chunks (reader calls) and pieces (ops after cutting to the buffer size); failed_op\n"
          "indexes the ops given. Sink (copy) failures raise CoreError.")
      .def("close", [](mio::StagePipeline& self) {
             py::gil_scoped_release nogil;
             self.close();
           },
           "Drain the copies, order the callers' streams after them, free the buffers and join\n"
           "the sink threads (idempotent; raises the first sink error after releasing all).")
      .def_property_readonly("closed", &mio::StagePipeline::closed)
      .def_property_readonly("ring", &mio::StagePipeline::ring)
      .def_property_readonly("buffer_bytes", &mio::StagePipeline::buffer_bytes)
      .def_property_readonly("pinned", &mio::StagePipeline::pinned)
      .def("stats", [](const mio::StagePipeline& self) {
             py::list out;
             using S = mio::SinkStats;
             for (const S& s : self.stats())
               out.append(metamat_py::as_dict(
                   s, MM_FIELD(S, copies), MM_FIELD(S, bytes), MM_FIELD(S, records),
                   MM_FIELD(S, waits), MM_FIELD(S, reuse_violations), MM_FIELD(S, max_pending),
                   MM_FIELD(S, began), MM_FIELD(S, finished)));
             return out;
           },
           "Per sink counters: copies, bytes, records, waits, reuse_violations, max_pending,\n"
           "began, finished (kept after close()).");
  m.def("host_pointer", &mio::host_pointer, py::arg("device_addr"),
        "The host address of page-locked host memory a GPU reaches at device_addr (fbgemm's\n"
        "host-mapped UVM tables), 0 when it is not such memory or there is no CUDA backend.");
  m.def("stage_live_buffers", &mio::stage_live_buffers,
        "Staging buffers allocated and not yet freed in this process (tests).");
  m.def("stage_pool_stats", [] {
        using S = mio::StagePoolStats;
        return metamat_py::as_dict(mio::stage_pool_stats(), MM_FIELD(S, cached_buffers),
                                   MM_FIELD(S, cached_bytes), MM_FIELD(S, hits),
                                   MM_FIELD(S, misses));
      },
      "Staging buffers kept for the next pipeline (metamat/stage_pool.h): cached_buffers,\n"
      "cached_bytes, and how many buffers were taken from the cache (hits) or allocated.");
  m.def("stage_free_cached", [] {
        py::gil_scoped_release nogil;
        return mio::stage_free_cached();
      },
      "Free every cached staging buffer (page-locked ones included); returns the bytes freed.");
  m.def("reader_threads_started", &mio::reader_threads_started,
        "Reader threads started in this process so far (tests).");
  m.def("stage_live_threads", &mio::stage_live_threads,
        "Copy-sink threads running in this process (tests).");
  m.def(
      "xxh3_64",
      [](uintptr_t addr, int64_t len, const std::vector<int64_t>& splits) {
        if (len < 0) throw py::value_error("negative length");
        const auto* p = reinterpret_cast<const unsigned char*>(addr);
        py::gil_scoped_release nogil;
        metamat::Xxh3 h;
        int64_t at = 0;
        for (int64_t s : splits) {  // pieces [at, s), then the rest
          s = std::min(std::max(s, at), len);
          h.update(p + at, size_t(s - at));
          at = s;
        }
        h.update(p + at, size_t(len - at));
        return h.digest();
      },
      py::arg("addr"), py::arg("length"), py::arg("splits") = std::vector<int64_t>(),
      "XXH3-64 (seed 0) of `length` bytes at `addr`, streamed in pieces cut at `splits`\n"
      "(ascending offsets): the same digest for any split.");
  m.def("xxh3_kernel", [](const std::string& set) {
        if (!set.empty() && !metamat::Xxh3::set_kernel(set.c_str()))
          throw py::value_error("xxh3 kernel must be 'scalar' or 'best'");
        return std::string(metamat::Xxh3::kernel());
      }, py::arg("set") = "",
      "The XXH3 long-loop kernel in use ('avx2' or 'scalar'); set='scalar'|'best' (tests).");
  m.def(
      "resident_fraction",
      [](const std::string& path, int64_t offset, int64_t length) {
        std::string err;
        struct stat st;
        const int fd = mio::open_regular(path, 0, &st, &err);
        if (fd < 0) throw std::runtime_error(path + ": " + err);
        const double f = mio::resident_fraction(fd, offset, length < 0 ? int64_t(st.st_size) - offset : length);
        ::close(fd);
        return f;
      },
      py::arg("path"), py::arg("offset") = 0, py::arg("length") = -1,
      "Fraction of the pages of [offset, offset+length) of `path` in the page cache (mincore;\n"
      "-1 if it cannot be told). For tests and benchmarks.");
  m.def(
      "convert",
      [](uintptr_t src, int64_t src_dtype, uintptr_t dst, int64_t dst_dtype, int64_t count) {
        py::gil_scoped_release nogil;
        mio::convert(reinterpret_cast<const void*>(src), mio::DType(src_dtype),
                     reinterpret_cast<void*>(dst), mio::DType(dst_dtype), count);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"),
      py::arg("count"), "Convert `count` floats between DType codes (DTYPE_CODES: float32, float16, bfloat16).");
}
