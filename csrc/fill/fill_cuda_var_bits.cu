// Init kernel variants (fill_variant.h) built with METAMAT_FILL_VARIANTS=1: the diagnostic `philoxbits` (Philox + stores)
// (one or two kernels per file: the files compile in parallel).
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_bits(int variant, const VariantLaunch& l) {
  switch (variant) {
    case kVarPhiloxBits:
      launch_fill_v<CfgBits, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
      return true;
    default:
      return false;
  }
}

}  // namespace metamat
