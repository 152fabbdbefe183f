// Init kernel variants (fill_variant.h) built with METAMAT_FILL_VARIANTS=1: the measured kernel
// with several tiles per block; `math` is fill_cuda_var_math.cu (one generic kernel per file:
// the files compile in parallel), reached through here as the spec files' fallback.
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_math(int variant, const VariantLaunch& l);  // fill_cuda_var_math.cu

bool launch_variant_a(int variant, const VariantLaunch& l) {
  switch (variant) {
    case kVarBase:
      launch_fill_v<CfgBase, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
      return true;
    default:
      return launch_variant_math(variant, l);
  }
}

}  // namespace metamat
