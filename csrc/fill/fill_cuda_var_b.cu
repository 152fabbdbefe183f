// Init kernel variants (fill_variant.h) built with METAMAT_FILL_VARIANTS=1: Philox's products as IMAD.HI + IMAD on every lane (`split`)
// (one or two kernels per file: the files compile in parallel).
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_b(int variant, const VariantLaunch& l) {
  switch (variant) {
    case kVarSplit:
      launch_fill_v<CfgSplit, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
      return true;
    default:
      return false;
  }
}

}  // namespace metamat
