// Init kernel variant `math` (fill_variant.h), built with METAMAT_FILL_VARIANTS=1: the generic
// kernel with the value-preserving shortcuts (launched through fill_cuda_var_a.cu).
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_math(int variant, const VariantLaunch& l) {
  if (variant != kVarMath) return false;
  launch_fill_v<CfgMath, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
  return true;
}

}  // namespace metamat
