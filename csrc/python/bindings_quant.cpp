// pybind11 bindings of the row-wise quantizer (quant_rowwise.h): argument plumbing only.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "metamat/quant_rowwise.h"

namespace py = pybind11;

void metamat_bind_quant(py::module_& m) {
  using metamat::quant::QuantOut;
  m.attr("QUANT_OUT_FIELDS") = static_cast<int>(sizeof(QuantOut) / sizeof(int64_t));
  m.def(
      "quantize_rows",
      [](uintptr_t src, int64_t rows, int64_t cols, int64_t src_stride, uintptr_t outs,
         int64_t nouts, int threads, const std::string& isa) {
        py::gil_scoped_release nogil;
        metamat::quant::quantize_rows(reinterpret_cast<const float*>(src), rows, cols,
                                      src_stride, reinterpret_cast<const QuantOut*>(outs),
                                      nouts, threads, isa.c_str());
      },
      py::arg("src_addr"), py::arg("rows"), py::arg("cols"), py::arg("src_stride"),
      py::arg("outs_addr"), py::arg("nouts"), py::arg("threads") = 1, py::arg("isa") = "",
      "Quantize `rows` float32 rows of `cols` elements (row stride `src_stride` elements)\n"
      "into the `nouts` destinations of the (nouts, 6) int64 array at `outs_addr`\n"
      "(col0, cols, dst address, dst row stride in bytes, kind 2/4/8/16/32, sb_last):\n"
      "fbgemm's row-wise INT-N (fp16 scale/bias) rows, or FP16/FP32 rows.");
  m.def("quant_isa", &metamat::quant::default_isa,
        "The quantizer's kernel on this CPU: 'avx2' or 'scalar'.");
}
