// pybind11 bindings of the checkpoint reader (io_reader.h): argument plumbing, GIL release.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "io_reader.h"

namespace py = pybind11;

void metamat_bind_io(py::module_& m) {
  namespace mio = metamat::io;
  m.attr("READ_OP_FIELDS") = 9;
  m.def(
      "read_ops",
      [](const std::vector<std::string>& files, uintptr_t ops_addr, int64_t count, int threads,
         int64_t task_bytes, int64_t bounce_bytes, int64_t coalesce_gap) {
        mio::ReadOptions opt;
        opt.threads = threads;
        opt.task_bytes = task_bytes;
        opt.bounce_bytes = bounce_bytes;
        opt.coalesce_gap = coalesce_gap;
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
      py::arg("coalesce_gap") = 4096,
      "Execute `count` packed ReadOps (9 int64 each: file_index, file_offset, row_bytes, rows,\n"
      "src_stride, dst_stride, dst, src_dtype, dst_dtype) at `ops_addr`.\n"
      "Returns (ok, error, failed_op, bytes_read, wrote).");
  m.def(
      "convert",
      [](uintptr_t src, int64_t src_dtype, uintptr_t dst, int64_t dst_dtype, int64_t count) {
        py::gil_scoped_release nogil;
        mio::convert(reinterpret_cast<const void*>(src), mio::DType(src_dtype),
                     reinterpret_cast<void*>(dst), mio::DType(dst_dtype), count);
      },
      py::arg("src"), py::arg("src_dtype"), py::arg("dst"), py::arg("dst_dtype"),
      py::arg("count"), "Convert `count` floats between DType codes 1=f32, 2=f16, 3=bf16.");
}
