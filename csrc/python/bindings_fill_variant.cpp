// pybind11 bindings of the GPU speed work's hidden entry points: the init kernel's variants
// (metamat/fill_variant.h) for A/B benches and the tests that run every variant through the
// emulation, and the device-side conversion's per-element check (csrc/stage/convert_elem.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "metamat/fill.h"
#include "metamat/fill_variant.h"
#include "dicts.h"
#include "stage/convert_elem_check.h"

namespace py = pybind11;

namespace {

const metamat::Segment* as_segs(uintptr_t addr) {
  return reinterpret_cast<const metamat::Segment*>(addr);
}

}  // namespace

void metamat_bind_fill_variant(py::module_& m) {
  m.def(
      "fill_variants",
      [] {
        py::list out;
        using V = metamat::FillVariantInfo;
        for (const V& v : metamat::fill_variants())
          out.append(metamat_py::as_dict(v, MM_FIELD(V, id), MM_FIELD(V, name),
                                         MM_FIELD(V, diagnostic), MM_FIELD(V, specialized),
                                         MM_FIELD(V, what)));
        return out;
      },
      "The CUDA init kernel's variants (id, name, diagnostic, specialized, what).");
  m.def("fill_variants_built", &metamat::fill_variants_built,
        "Whether this build has the variants' device kernels (METAMAT_FILL_VARIANTS=1).");
  m.def(
      "fill_options",
      [](int variant, int tiles_per_block) {
        const auto o = metamat::resolve_fill_options({variant, tiles_per_block});
        return py::make_tuple(o.variant, o.tiles_per_block);
      },
      py::arg("variant") = -1, py::arg("tiles_per_block") = -1,
      "(variant, tiles_per_block) a fill would use: negative fields from METAMAT_FILL_VARIANT /\n"
      "METAMAT_FILL_TILES; raises CoreError for unknown ones.");
  m.def(
      "fill_cuda_variant",
      [](uintptr_t segs, int64_t n, uintptr_t staging, uintptr_t dev_scratch, uintptr_t stream,
         int variant, int tiles_per_block) {
        py::gil_scoped_release nogil;
        metamat::fill_cuda(as_segs(segs), n, reinterpret_cast<metamat::Segment*>(staging),
                           reinterpret_cast<void*>(dev_scratch), reinterpret_cast<void*>(stream),
                           {variant, tiles_per_block});
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("staging"), py::arg("dev_scratch"),
      py::arg("stream"), py::arg("variant") = -1, py::arg("tiles_per_block") = -1,
      "fill_cuda with a kernel variant and tiles per block (negative: the environment's).");
  m.def(
      "fill_cuda_emulated_variant",
      [](uintptr_t segs, int64_t n, bool force_wide, int variant, int tiles_per_block) {
        metamat::EmulationStats st;
        {
          py::gil_scoped_release nogil;
          st = metamat::fill_cuda_emulated(as_segs(segs), n, force_wide,
                                           {variant, tiles_per_block});
        }
        return metamat_py::emulation_dict(st);
      },
      py::arg("segments_addr"), py::arg("count"), py::arg("force_wide") = false,
      py::arg("variant") = -1, py::arg("tiles_per_block") = -1,
      "fill_cuda_emulated with a kernel variant and tiles per block.");
  m.def(
      "fill_variant_math_check",
      [](const std::string& fn, float param) {
        metamat::VariantMathCheck r;
        {
          py::gil_scoped_release nogil;
          r = metamat::fill_variant_math_check(fn, param);
        }
        using R = metamat::VariantMathCheck;
        return metamat_py::as_dict(r, MM_FIELD(R, checked), MM_FIELD(R, mismatches),
                                   MM_FIELD(R, first_input), MM_FIELD(R, want_bits),
                                   MM_FIELD(R, got_bits), MM_FIELD(R, folded));
      },
      py::arg("fn"), py::arg("param") = 0.0f,
      "Test hook: a variant's math against the plain math over every input.");
  m.def(
      "convert_elem_check",
      [](int dst_dtype, uint32_t stride) {
        metamat::ConvertElemCheck r;
        {
          py::gil_scoped_release nogil;
          r = metamat::convert_elem_check(dst_dtype, stride);
        }
        using R = metamat::ConvertElemCheck;
        return metamat_py::as_dict(r, MM_FIELD(R, checked), MM_FIELD(R, mismatches),
                                   MM_FIELD(R, first_input));
      },
      py::arg("dst_dtype"), py::arg("stride") = 1,
      "Test hook: the device conversion's per-element function against the host conversion\n"
      "over every `stride`-th fp32 bit pattern (dst_dtype: DTYPE_CODES float16/bfloat16).");
}
