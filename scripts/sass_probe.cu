// Probe kernels for scripts/sass_unit_counts.sh: each runs ONE work unit of one path
// (interior or edge) for one (distribution, dtype), so its SASS up to the first EXIT is what
// a thread executes per unit (slow paths such as the IEEE sqrt fix-up sit after the EXIT).
#include "fill_sink_cuda.cuh"

namespace metamat {

template <DistKind K, class T>
__global__ void interior_probe(const Segment* segs, int64_t u) {
  const Segment& s = segs[0];
  DeviceSink out;
  const UnitPos p = unit_pos<T::kSize>(s, u);
  interior_unit<K, T>(s, p, p.row + static_cast<uintptr_t>(p.cb * T::kSize), out);
}

template <DistKind K, class T>
__global__ void edge_probe(const Segment* segs, int64_t u) {
  const Segment& s = segs[0];
  DeviceSink out;
  const UnitPos p = unit_pos<T::kSize>(s, u);
  edge_unit<K, T>(s, p, p.row + static_cast<uintptr_t>(p.cb * T::kSize), out);
}

#define MM_PROBE(K, T)                                                        \
  template __global__ void interior_probe<DistKind::K, T>(const Segment*, int64_t); \
  template __global__ void edge_probe<DistKind::K, T>(const Segment*, int64_t);
MM_PROBE(kUniform, F32) MM_PROBE(kUniform, BF16) MM_PROBE(kUniform, F16) MM_PROBE(kUniform, F64)
MM_PROBE(kNormal, F32) MM_PROBE(kNormal, BF16) MM_PROBE(kTruncNormal, F32)
MM_PROBE(kTruncNormal, BF16) MM_PROBE(kConstant, F32) MM_PROBE(kConstant, BF16)

}  // namespace metamat
