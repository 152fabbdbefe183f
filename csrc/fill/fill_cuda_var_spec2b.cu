// Init kernel variant `spec2b` (fill_variant.h), built with METAMAT_FILL_VARIANTS=1: the
// specialized kernels of `spec` (fill_kernel.cuh launch_pair) bounded for 2 blocks per SM, as
// the measured kernel: no spills (108-128 registers), so `math` is compared without them.
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_spec2b(int variant, const VariantLaunch& l) {
  if (variant != kVarSpec2Blocks) return false;
  return launch_pair<CfgMath, 2>(l) || launch_variant_a(kVarMath, l);
}

}  // namespace metamat
