// Init kernel variants (fill_variant.h) built with METAMAT_FILL_VARIANTS=1: the measured kernel with several tiles per block, and `math`
// (one or two kernels per file: the files compile in parallel).
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_a(int variant, const VariantLaunch& l) {
  switch (variant) {
    case kVarBase:
      launch_fill_v<CfgBase, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
      return true;
    case kVarMath:
      launch_fill_v<CfgMath, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
      return true;
    default:
      return false;
  }
}

}  // namespace metamat
