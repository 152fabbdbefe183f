// pybind11 bindings only: argument plumbing, GIL release. No logic lives here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "metamat/check.h"
#include "metamat/fill.h"
#include "fill/fill_cpu.h"
#include "dicts.h"

namespace py = pybind11;

void metamat_bind_io(py::module_& m);    // bindings_io.cpp: the checkpoint reader
void metamat_bind_pack(py::module_& m);  // bindings_pack.cpp: fill_many_'s segment packer
void metamat_bind_graph(py::module_& m);  // bindings_graph.cpp: the TorchRec object-graph walk
void metamat_bind_zip(py::module_& m);    // bindings_zip.cpp: DCP's torch.save blobs located
void metamat_bind_pickle(py::module_& m);  // bindings_pickle.cpp: a pickle's opcodes bounded
void metamat_bind_fill_variant(py::module_& m);  // bindings_fill_variant.cpp: kernel variants
void metamat_bind_quant(py::module_& m);   // bindings_quant.cpp: row-wise quantization

namespace {

const metamat::Segment* as_segments(uintptr_t addr) {
  return reinterpret_cast<const metamat::Segment*>(addr);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "metamat core: torch-free fused init and checkpoint reading";
  py::register_exception<metamat::CoreError>(m, "CoreError", PyExc_RuntimeError);

  m.attr("SEGMENT_BYTES") = static_cast<int>(sizeof(metamat::Segment));
  {
    using metamat::DType;
    py::dict codes;  // mirrored by metamat/dtypes.py (tests compare the two)
    codes["raw"] = int(DType::kRaw);
    codes["float32"] = int(DType::kFloat32);
    codes["float16"] = int(DType::kFloat16);
    codes["bfloat16"] = int(DType::kBFloat16);
    codes["float64"] = int(DType::kFloat64);
    m.attr("DTYPE_CODES") = codes;
  }

  m.def(
      "fill_cpu",
      [](uintptr_t segs, int64_t n, int num_threads, const std::string& isa) {
        py::gil_scoped_release nogil;
        metamat::fill_cpu(as_segments(segs), n, num_threads, isa);
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("num_threads"), py::arg("isa") = "",
      "Fill CPU memory described by `count` packed Segments at `segments_addr`.");

  m.def("cpu_kernel", &metamat::cpu_kernel_name, "The CPU fill kernel in use (ISA).");
  m.def("cpu_kernel_choice", &metamat::cpu_kernel_choice,
        "Why that kernel: the CPUID rule, METAMAT_CPU_KERNEL, or a measurement's timings.");
  m.def("cpu_kernels", &metamat::cpu_kernels_runnable,
        "The CPU fill kernels this CPU can run (fill_cpu's isa), widest first.");
  m.def(
      "cpu_math",
      [](const std::string& fn, const std::string& isa, uintptr_t in, uintptr_t out,
         int64_t n) {
        py::gil_scoped_release nogil;
        metamat::cpu_math(fn, isa, reinterpret_cast<const void*>(in),
                          reinterpret_cast<void*>(out), n);
      },
      py::arg("fn"), py::arg("isa"), py::arg("in_addr"), py::arg("out_addr"), py::arg("count"),
      "Test hook: one transform of a CPU kernel (or 'scalar') over count inputs.");
  m.def("cuda_compiled", &metamat::cuda_compiled, "True if the CUDA backend was built.");
  m.def("cuda_device_count", &metamat::cuda_device_count,
        "Usable CUDA devices for this build (0 when none or no driver).");
  m.def(
      "fill_cuda",
      [](uintptr_t segs, int64_t n, uintptr_t staging, uintptr_t dev_scratch, uintptr_t stream) {
        py::gil_scoped_release nogil;
        metamat::fill_cuda(as_segments(segs), n, reinterpret_cast<metamat::Segment*>(staging),
                           reinterpret_cast<void*>(dev_scratch), reinterpret_cast<void*>(stream));
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("staging"), py::arg("dev_scratch"),
      py::arg("stream"),
      "Fill CUDA memory in one launch on `stream`. `staging` (host, page-locked for an async\n"
      "upload; may equal segments_addr) and `dev_scratch` (device) hold count*SEGMENT_BYTES\n"
      "and must stay alive until the stream passes the launch.");

  m.def(
      "fill_cuda_emulated",
      [](uintptr_t segs, int64_t n, bool force_wide) {
        metamat::EmulationStats st;
        {
          py::gil_scoped_release nogil;
          st = metamat::fill_cuda_emulated(as_segments(segs), n, force_wide);
        }
        return metamat_py::emulation_dict(st);
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("force_wide") = false,
      "Run the CUDA launch (segment table, block search, per-thread units, vector/scalar\n"
      "store decisions) on the host, writing CPU memory; returns what it did (counts).");

  metamat_bind_io(m);
  metamat_bind_pack(m);
  metamat_bind_graph(m);
  metamat_bind_zip(m);
  metamat_bind_pickle(m);
  metamat_bind_quant(m);
  metamat_bind_fill_variant(m);
}
