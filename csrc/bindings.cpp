// pybind11 bindings only: argument plumbing, GIL release. No logic lives here.
#include <pybind11/pybind11.h>

#include "check.h"
#include "fill.h"

namespace py = pybind11;

void metamat_bind_io(py::module_& m);  // bindings_io.cpp: the checkpoint reader

namespace {

const metamat::Segment* as_segments(uintptr_t addr) {
  return reinterpret_cast<const metamat::Segment*>(addr);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "metamat core: torch-free fused init and checkpoint reading";
  py::register_exception<metamat::CoreError>(m, "CoreError", PyExc_RuntimeError);

  m.attr("SEGMENT_BYTES") = static_cast<int>(sizeof(metamat::Segment));

  m.def(
      "fill_cpu",
      [](uintptr_t segs, int64_t n, int num_threads, const std::string& isa) {
        py::gil_scoped_release nogil;
        metamat::fill_cpu(as_segments(segs), n, num_threads, isa);
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("num_threads"), py::arg("isa") = "",
      "Fill CPU memory described by `count` packed Segments at `segments_addr`.");

  m.def("cpu_kernel", &metamat::cpu_kernel_name, "The CPU fill kernel in use (ISA).");
  m.def("cuda_compiled", &metamat::cuda_compiled, "True if the CUDA backend was built.");
  m.def("cuda_device_count", &metamat::cuda_device_count,
        "Usable CUDA devices for this build (0 when none or no driver).");
  m.def(
      "fill_cuda",
      [](uintptr_t segs, int64_t n, uintptr_t dev_scratch, uintptr_t stream) {
        py::gil_scoped_release nogil;
        metamat::fill_cuda(as_segments(segs), n, reinterpret_cast<void*>(dev_scratch),
                           reinterpret_cast<void*>(stream));
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("dev_scratch"), py::arg("stream"),
      "Fill CUDA memory in one launch on `stream`; dev_scratch holds count*SEGMENT_BYTES.");

  m.def(
      "fill_cuda_emulated",
      [](uintptr_t segs, int64_t n) {
        py::gil_scoped_release nogil;
        metamat::fill_cuda_emulated(as_segments(segs), n);
      },
      py::arg("segments_addr"), py::arg("count"),
      "Run the CUDA launch's tiles and per-unit work on the host, writing CPU memory.");

  metamat_bind_io(m);
}
