// Init kernel variants (fill_variant.h) built with METAMAT_FILL_VARIANTS=1: one kernel per
// (dtype, distribution) (fill_kernel.cuh launch_pair), whose registers are only what that path
// needs, so more blocks fit an SM (`spec`: math; `specsplit` is fill_cuda_var_spec2.cu). A
// launch whose segments do not share one of these pairs runs the generic kernel of the config.
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_spec(int variant, const VariantLaunch& l) {
  switch (variant) {
    case kVarSpecialized:
      return launch_pair<CfgMath>(l) || launch_variant_a(kVarMath, l);
    default:
      return false;
  }
}

}  // namespace metamat
