// Init kernel variants (fill_variant.h) built with METAMAT_FILL_VARIANTS=1: plain st.global stores (`plainstore`)
// (one or two kernels per file: the files compile in parallel).
#include "fill_kernel.cuh"

namespace metamat {

bool launch_variant_c(int variant, const VariantLaunch& l) {
  switch (variant) {
    case kVarPlainStore:
      launch_fill_v<CfgPlainStore, AnyPair, 2>(l.dsegs, l.nseg, l.tiles, l.per, l.stream);
      return true;
    default:
      return false;
  }
}

}  // namespace metamat
