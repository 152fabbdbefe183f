// Probe kernels for scripts/sass_unit_counts.sh and scripts/sass_kernel_mix.py: each runs ONE
// work unit of one path for one (distribution, dtype), so its SASS up to the first EXIT is what
// a thread executes per unit (slow paths such as the IEEE sqrt fix-up sit after the EXIT).
//   interior_probe / edge_probe  a unit with its own stores (DeviceSink), as before staging
//   staged_probe<Cfg>            the kernel's store path for interior units (fill_warp_work.h):
//                                the unit into the lane's shared-memory slot, __syncwarp, the
//                                lane's share of the warp's write-out; per kernel variant
//   fn_probe<F>                  one call of a transform piece on a loaded word (its cost is
//                                the probe's count less that of fn_probe<kNothing>)
#include "fill/fill_sink_cuda.cuh"

namespace metamat {

template <DistKind K, class T>
__global__ void interior_probe(const Segment* segs, int64_t u) {
  const Segment& s = segs[0];
  DeviceSink out;
  const UnitPos p = unit_pos<T::kSize>(s, u);
  interior_unit<CfgBase, K, T>(s, p, p.row + static_cast<uintptr_t>(p.cb * T::kSize), out);
}

template <DistKind K, class T>
__global__ void edge_probe(const Segment* segs, int64_t u) {
  const Segment& s = segs[0];
  DeviceSink out;
  const UnitPos p = unit_pos<T::kSize>(s, u);
  edge_unit<CfgBase, K, T>(s, p, p.row + static_cast<uintptr_t>(p.cb * T::kSize), out);
}

#define MM_PROBE(K, T)                                                        \
  template __global__ void interior_probe<DistKind::K, T>(const Segment*, int64_t); \
  template __global__ void edge_probe<DistKind::K, T>(const Segment*, int64_t);
MM_PROBE(kUniform, F32) MM_PROBE(kUniform, BF16) MM_PROBE(kUniform, F16) MM_PROBE(kUniform, F64)
MM_PROBE(kNormal, F32) MM_PROBE(kNormal, BF16) MM_PROBE(kTruncNormal, F32)
MM_PROBE(kTruncNormal, BF16) MM_PROBE(kConstant, F32) MM_PROBE(kConstant, BF16)

// The staged store path of one interior unit per lane. The math variants run their common body
// (every scale but those below 2^-102 folds; TruncatedNormal truncated within +-2.5 std).
template <class Cfg, DistKind K, class T>
__global__ void staged_probe(const Segment* segs, int64_t u) {
  __shared__ __align__(16) unsigned char stage[kStageBytes];
  __shared__ uintptr_t staged_at[kTileThreads];
  const Segment& s = segs[0];
  const int lane = threadIdx.x % kWarpSize, warp0 = int(threadIdx.x) - lane;
  const UnitPos p = unit_pos<T::kSize, true>(s, u + threadIdx.x);  // segments < 2^31 units
  const uintptr_t a = p.row + static_cast<uintptr_t>(p.cb * T::kSize);
  auto slot = DeviceSlots{}.make<T>(stage + threadIdx.x * StagedSlot<T>::kStride, a);
  constexpr int mode = !Cfg::math || Cfg::bits ? 0
                       : K == DistKind::kUniform ? kModeFold
                       : K == DistKind::kTruncNormal ? kModeFold | kModeCentral : 0;
  interior_unit_body<Cfg, K, T, mode>(s, p, a, slot);
  staged_at[threadIdx.x] = a;
  __syncwarp();
  write_out_lane<T>(warp0, lane, stage, staged_at, DeviceStoreT<Cfg::store>{});
}

#define MM_STAGED(C, K, T) template __global__ void staged_probe<C, DistKind::K, T>(const Segment*, int64_t);
#define MM_STAGED_ALL(C)                                                                  \
  MM_STAGED(C, kUniform, F32) MM_STAGED(C, kNormal, F32) MM_STAGED(C, kTruncNormal, F32)  \
  MM_STAGED(C, kUniform, BF16) MM_STAGED(C, kNormal, BF16) MM_STAGED(C, kTruncNormal, BF16) \
  MM_STAGED(C, kUniform, F16) MM_STAGED(C, kConstant, F32) MM_STAGED(C, kConstant, BF16)
MM_STAGED_ALL(CfgBase)
MM_STAGED_ALL(CfgMath)
MM_STAGED_ALL(CfgSplit)
MM_STAGED(CfgBits, kUniform, F32) MM_STAGED(CfgBits, kUniform, BF16)

// One transform piece on word w = in[threadIdx.x]; result stored. fn_probe<kNothing> stores w.
enum Piece : int {
  kNothing, kPhilox1, kPhilox1Split, kUniform, kUniformFold, kLog, kLogOpen0, kSinCos,
  kSinCosSel, kSqrt, kBoxMuller, kBoxMullerSel, kErfinv, kErfinvCentralP, kPackBf16
};
template <int F>
__global__ void fn_probe(const uint32_t* in, float* out, float a, float b) {
  const uint32_t w = in[threadIdx.x];
  float r = 0.0f, r2 = 0.0f;
  if constexpr (F == kNothing) r = __uint_as_float(w);
  if constexpr (F == kPhilox1 || F == kPhilox1Split) {  // one Philox4x32-10 call, 4 words
    UnitPos p{0, 0, w, w ^ 1u, w ^ 2u, w ^ 3u};
    uint32_t x[4][1];
    philox_lanes<1, F == kPhilox1Split ? 1 : 0>(p, (uint64_t(__float_as_uint(b)) << 32) |
                                                         __float_as_uint(a), w, x);
    r = __uint_as_float(x[0][0] ^ x[1][0] ^ x[2][0] ^ x[3][0]);
  }
  if constexpr (F == kUniform) r = a + uniform01(w) * b;
  if constexpr (F == kUniformFold) r = a + static_cast<float>(w >> 8) * b;
  if constexpr (F == kLog) r = mm_logf(uniform01_open0(w));
  if constexpr (F == kLogOpen0) r = mm_log_open0(w);
  if constexpr (F == kSinCos) mm_sincos_turns(w >> 8, &r, &r2);
  if constexpr (F == kSinCosSel) mm_sincos_turns_sel(w >> 8, &r, &r2);
  if constexpr (F == kSqrt) r = __fsqrt_rn(__uint_as_float(w));
  if constexpr (F == kBoxMuller) box_muller(w, w * 747796405u, &r, &r2);
  if constexpr (F == kBoxMullerSel) box_muller_sel(w, w * 747796405u, &r, &r2);
  if constexpr (F == kErfinv) r = mm_erfinvf(__uint_as_float(w));
  if constexpr (F == kErfinvCentralP) r = mm_erfinvf_central(__uint_as_float(w));
  if constexpr (F == kPackBf16) r = __uint_as_float(pack2(BF16{}, __uint_as_float(w), a));
  out[threadIdx.x] = r;
  if constexpr (F == kSinCos || F == kSinCosSel || F == kBoxMuller || F == kBoxMullerSel)
    out[threadIdx.x + 1024] = r2;
}
#define MM_FN(F) template __global__ void fn_probe<F>(const uint32_t*, float*, float, float);
MM_FN(kNothing) MM_FN(kPhilox1) MM_FN(kPhilox1Split) MM_FN(kUniform) MM_FN(kUniformFold)
MM_FN(kLog) MM_FN(kLogOpen0) MM_FN(kSinCos) MM_FN(kSinCosSel) MM_FN(kSqrt) MM_FN(kBoxMuller)
MM_FN(kBoxMullerSel) MM_FN(kErfinv) MM_FN(kErfinvCentralP) MM_FN(kPackBf16)

}  // namespace metamat
