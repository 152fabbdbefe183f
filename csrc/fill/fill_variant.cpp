// The CUDA init kernel's variants by id and name, and the run-time choice (fill_variant.h).
#include "metamat/fill_variant.h"

#include <cstdlib>
#include <string>

#include "metamat/check.h"
#include "fill_units.h"
#include "metamat/philox.h"

namespace metamat {

const std::vector<FillVariantInfo>& fill_variants() {
  static const std::vector<FillVariantInfo> v = {
      {kVarBase, "base", false, false, "the kernel measured on the H100/H200 (stops 26-35)"},
      {kVarMath, "math", false, false,
       "value-preserving shortcuts: 2^-24 folded into the scale, Box-Muller log of the integer, "
       "sin/cos quadrant by select and sign bit, erfinv without its w >= 5 polynomial where "
       "the truncation excludes it"},
      {kVarSplit, "split", false, false, "math + Philox products as IMAD.HI + IMAD (all lanes)"},
      {kVarHalfSplit, "halfsplit", false, false,
       "math + Philox products as IMAD.HI + IMAD on lanes 4..7, IMAD.WIDE on 0..3"},
      {kVarPlainStore, "plainstore", false, false, "math + plain st.global (not .wb)"},
      {kVarStreamStore, "streamstore", false, false, "math + st.global.cs (evict-first)"},
      {kVarSpecialized, "spec", false, true,
       "math, one kernel per (dtype, distribution) at 3 blocks per SM when a launch has one pair"},
      {kVarSpecSplit, "specsplit", false, true, "spec + split"},
      {kVarSpec2Blocks, "spec2b", false, true,
       "math, one kernel per (dtype, distribution) at 2 blocks per SM (no register spills)"},
      {kVarPhiloxBits, "philoxbits", true, false,
       "DIAGNOSTIC (values differ): Uniform stores the raw Philox word: Philox + stores only"},
  };
  return v;
}

const FillVariantInfo& fill_variant(const std::string& id_or_name) {
  const bool digits = !id_or_name.empty() &&
                      id_or_name.find_first_not_of("0123456789") == std::string::npos &&
                      id_or_name.size() < 6;
  for (const auto& v : fill_variants()) {
    if (digits ? v.id == std::stoi(id_or_name) : id_or_name == v.name) return v;
  }
  std::string known;
  for (const auto& v : fill_variants())
    known += (known.empty() ? "" : ", ") + std::to_string(v.id) + "=" + v.name;
  fail(__FILE__, __LINE__, "unknown init kernel variant '" + id_or_name + "' (known: " + known + ")");
}

FillOptions resolve_fill_options(FillOptions o) {
  if (o.variant < 0) {
    const char* e = std::getenv("METAMAT_FILL_VARIANT");
    o.variant = (e != nullptr && *e != '\0') ? fill_variant(e).id : kVarBase;
  } else {
    fill_variant(std::to_string(o.variant));  // validates
  }
  if (o.tiles_per_block < 0) {
    const char* e = std::getenv("METAMAT_FILL_TILES");
    if (e != nullptr && *e != '\0') {
      char* end = nullptr;
      const long t = std::strtol(e, &end, 10);
      MM_CHECK(end != e && *end == '\0' && t >= 1 && t <= 4096,
               std::string("METAMAT_FILL_TILES must be an integer in [1, 4096], got '") + e + "'");
      o.tiles_per_block = static_cast<int>(t);
    } else {
      o.tiles_per_block = 1;
    }
  }
  MM_CHECK(o.tiles_per_block >= 1 && o.tiles_per_block <= 4096,
           "tiles_per_block must be in [1, 4096]");
  return o;
}

}  // namespace metamat

// ---- Test hooks: the variant math against the plain math, over every input ---------------
namespace metamat {

bool fill_variants_built() {
#if defined(METAMAT_FILL_VARIANTS)
  return true;
#else
  return false;
#endif
}

VariantMathCheck fill_variant_math_check(const std::string& fn, float param) {
  VariantMathCheck r;
  auto differ = [](float a, float b) { return float_to_bits(a) != float_to_bits(b); };
  auto note = [&](uint64_t input, float want, float got) {
    if (r.mismatches++ == 0) {
      r.first_input = input;
      r.want_bits = float_to_bits(want);
      r.got_bits = float_to_bits(got);
    }
  };
  if (fn == "log_open0") {  // every 24-bit input of the Box-Muller radius
    for (uint32_t k = 0; k < (1u << 24); ++k, ++r.checked) {
      const uint32_t w = (k << 8) | (k & 0xffu);
      const float want = mm_logf(uniform01_open0(w)), got = mm_log_open0(w);
      if (differ(want, got)) note(w, want, got);
    }
  } else if (fn == "sincos") {  // every 24-bit angle
    for (uint32_t k = 0; k < (1u << 24); ++k, ++r.checked) {
      float s0, c0, s1, c1;
      mm_sincos_turns(k, &s0, &c0);
      mm_sincos_turns_sel(k, &s1, &c1);
      if (differ(s0, s1)) note(k, s0, s1);
      if (differ(c0, c1)) note(k | (uint64_t{1} << 32), c0, c1);
    }
  } else if (fn == "uniform_fold") {  // every 24-bit word at scale `param` (a = 0.25)
    Segment s{};
    s.dist.kind = int32_t(DistKind::kUniform);
    s.dist.p0 = 0.25f;
    s.dist.p1 = param;
    variant_fields(s);
    r.folded = (s.launch.flags & kFoldedScale) != 0;
    const float sc = bits_to_float(s.launch.scale);
    for (uint32_t k = 0; k < (1u << 24); ++k, ++r.checked) {
      const uint32_t w = k << 8;
      const float want = s.dist.p0 + uniform01(w) * s.dist.p1;
      const float got = r.folded ? s.dist.p0 + static_cast<float>(w >> 8) * sc : want;
      if (differ(want, got)) note(w, want, got);
    }
  } else if (fn == "erfinv") {  // 2^24 floats spread over (-0.99, 0.99) and its edges
    const uint32_t top = float_to_bits(0.99f);
    for (uint32_t k = 0; k < (1u << 24); ++k, ++r.checked) {
      const uint32_t b = static_cast<uint32_t>((uint64_t{k >> 1} * top) >> 23);
      const float x = bits_to_float(b | ((k & 1u) << 31));
      const float want = mm_erfinvf(x), got = mm_erfinvf_central(x);
      if (differ(want, got)) note(b, want, got);
    }
    for (uint32_t b = top - 65536; b <= top + 2; ++b, ++r.checked) {  // |x| up to just past 0.99
      const float x = bits_to_float(b);
      if (differ(mm_erfinvf(x), mm_erfinvf_central(x))) note(b, mm_erfinvf(x), mm_erfinvf_central(x));
    }
  } else {
    fail(__FILE__, __LINE__, "unknown variant math check '" + fn + "'");
  }
  return r;
}

}  // namespace metamat
