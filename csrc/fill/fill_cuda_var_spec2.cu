// Init kernel variant `specsplit` (fill_variant.h), built with METAMAT_FILL_VARIANTS=1: the
// specialized kernels (fill_kernel.cuh launch_pair) with Philox's products as IMAD.HI + IMAD.
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_spec2(int variant, const VariantLaunch& l) {
  if (variant != kVarSpecSplit) return false;
  return launch_pair<CfgSplit>(l) || launch_variant_b(kVarSplit, l);
}

}  // namespace metamat
