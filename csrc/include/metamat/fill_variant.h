// Variants of the CUDA init kernel, for A/B timing against torch's fill_ in ONE process on a
// GPU (docs/PERFORMANCE.md "GPU kernel: instructions per byte"). Every variant but the
// diagnostic one writes the same bits as the CPU engine: they change which instructions compute
// the fixed float operations of philox.h, how the products of Philox are issued, which store
// instruction writes, which kernel runs and how many tiles a thread block walks; never the
// operations' order or rounding. The shared unit/warp code (fill_unit_work.h) takes the
// compile-time KernelCfg; the kernel (fill_cuda.cu, fill_cuda_variants*.cu) and its host
// emulation (fill_emulate.cpp) instantiate the same templates, so the CPU tests run every
// variant's indexing and math against the CPU engine.
//
// Run-time choice: fill_cuda / fill_cuda_emulated take a FillOptions; a negative variant or
// tiles_per_block means "from the environment": METAMAT_FILL_VARIANT (id or name, default 0)
// and METAMAT_FILL_TILES (tiles per thread block, default 1), read at every call so a bench can
// switch between calls. The device kernels of variants 1.. are compiled only in a build with
// METAMAT_FILL_VARIANTS=1 (they multiply the CUDA compile time); the emulation has them all.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace metamat {

// Compile-time configuration of the kernel's shared code.
//   math:  value-preserving shortcuts: Uniform/TruncatedNormal fold 2^-24 into the scale when
//          exact (one multiply less per value), the Box-Muller log takes its integer input and
//          skips the range select, sin/cos pick their quadrant with a select and a sign bit,
//          erfinv skips its w >= 5 polynomial where the truncation (|x| < 0.99 in erf space,
//          +-2.5 std) excludes it (philox.h, "Variant math"; fill_units.h variant_fields)
//   split: Philox's 32 x 32 -> 64-bit products: 0 one IMAD.WIDE.U32 each, 1 IMAD.HI.U32 + IMAD
//          on every lane, 2 on lanes 4..7 only (the two halves on different pipes' mixes)
//   store: device stores: 0 st.global.wb (the measured kernel), 1 plain st.global,
//          2 st.global.cs (evict-first streaming)
//   bits:  DIAGNOSTIC, values differ: Uniform segments store the raw Philox word (fp32: its
//          bits; 16-bit: converted), i.e. what Philox + the stores cost without a transform
template <bool kMath, int kSplit, int kStore, bool kBits>
struct KernelCfg {
  static constexpr bool math = kMath;
  static constexpr int split = kSplit;
  static constexpr int store = kStore;
  static constexpr bool bits = kBits;
};
using CfgBase = KernelCfg<false, 0, 0, false>;

enum FillVariantId : int {
  kVarBase = 0,          // the kernel measured on the H100/H200 (stops 26-35)
  kVarMath = 1,          // math
  kVarSplit = 2,         // math + split 1
  kVarHalfSplit = 3,     // math + split 2
  kVarPlainStore = 4,    // math + store 1
  kVarStreamStore = 5,   // math + store 2
  kVarSpecialized = 6,   // math, one kernel per (dtype, distribution) at 3 blocks per SM
  kVarSpecSplit = 7,     // math + split 1, specialized at 3 blocks per SM
  kVarSpec2Blocks = 8,   // math, specialized at 2 blocks per SM (no spills)
  kVarPhiloxBits = 100,  // diagnostic: bits (Uniform segments only)
};

// Config of each id (emulation and kernels dispatch through the same table).
using CfgMath = KernelCfg<true, 0, 0, false>;
using CfgSplit = KernelCfg<true, 1, 0, false>;
using CfgHalfSplit = KernelCfg<true, 2, 0, false>;
using CfgPlainStore = KernelCfg<true, 0, 1, false>;
using CfgStreamStore = KernelCfg<true, 0, 2, false>;
using CfgBits = KernelCfg<true, 0, 0, true>;

struct FillVariantInfo {
  int id;
  const char* name;
  bool diagnostic;   // values differ from the CPU engine: never a default, tests skip values
  bool specialized;  // one kernel per (dtype, distribution) when a launch has a single pair
  const char* what;
};
// Every variant, in id order.
const std::vector<FillVariantInfo>& fill_variants();
// The variant of `id_or_name` (an id as digits or a name); throws CoreError if unknown.
const FillVariantInfo& fill_variant(const std::string& id_or_name);

struct FillOptions {
  int variant = -1;          // < 0: METAMAT_FILL_VARIANT (default 0)
  int tiles_per_block = -1;  // < 0: METAMAT_FILL_TILES (default 1); >= 1: a block's tiles
};
// `o` with its negative fields taken from the environment, validated (CoreError if bad).
FillOptions resolve_fill_options(FillOptions o);

// Whether this build has the variants' device kernels (METAMAT_FILL_VARIANTS=1).
bool fill_variants_built();

// Test hook: `fn` ("log_open0", "sincos", "uniform_fold" at scale `param`, "erfinv") of the
// variant math against the plain math of philox.h over every input (2^24 of them).
struct VariantMathCheck {
  int64_t checked = 0, mismatches = 0;
  uint64_t first_input = 0;
  uint32_t want_bits = 0, got_bits = 0;
  bool folded = false;  // uniform_fold: whether the scale folded
};
VariantMathCheck fill_variant_math_check(const std::string& fn, float param = 0.0f);

// Calls f(Cfg{}) with the KernelCfg of `variant` (the emulation's dispatch; the kernels have
// their own launch table).
template <class F>
void with_kernel_cfg(int variant, F&& f) {
  switch (variant) {
    case kVarBase: return f(CfgBase{});
    case kVarMath: case kVarSpecialized: case kVarSpec2Blocks: return f(CfgMath{});
    case kVarSplit: case kVarSpecSplit: return f(CfgSplit{});
    case kVarHalfSplit: return f(CfgHalfSplit{});
    case kVarPlainStore: return f(CfgPlainStore{});
    case kVarStreamStore: return f(CfgStreamStore{});
    case kVarPhiloxBits: return f(CfgBits{});
    default: return f(CfgBase{});  // unreachable after resolve_fill_options
  }
}

}  // namespace metamat
