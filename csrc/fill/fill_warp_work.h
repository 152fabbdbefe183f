// A warp's units, with the interior ones' stores staged (the kernel's store path): run_warp_any.
// Shared by the CUDA kernel and the host emulation, as the thread's work (fill_unit_work.h).
#pragma once
#include <cstdint>

#include "fill_unit_work.h"

namespace metamat {

// Stored in place, a thread's 16-byte vectors land 32 * kSize bytes apart across a warp: every
// store instruction touches 32 lines for 16 bytes each (fp32 Uniform made 0.22x of fill_ on an
// H100 so). Instead an interior unit (fp32, fp16, bf16) is written into its thread's slot of a
// staging area (shared memory on the GPU) and the warp then writes all its slots out together:
// lane l of step i stores 16-byte chunk 32 i + l of the warp's units, 512 contiguous bytes per
// store instruction wherever the units are (a table's interior). Edge units and fp64 keep their
// own stores. The same units, transforms and bytes as run_thread; only the store order differs.
//
// Policies:
//   w.lanes(f)         f(lane) for the calling lane (CUDA) or for lanes 0..31 in turn (host)
//   w.sync()           __syncwarp (host: nothing; the lanes ran in turn)
//   slots.make<T>(p, a)  a Sink writing unit `a`'s vectors into slot p at their offsets in it
//   store.chunk16(dst, src)  16 bytes from the staging area to memory (16-byte aligned)
constexpr int kWarpSize = 32;
constexpr int kStagePad = 16;  // slot padding: 8 lanes' 16-byte writes hit 8 different banks

template <class T>
struct StagedSlot {
  static constexpr int kUnit = 32 * T::kSize;  // bytes of one unit: 128 fp32, 64 fp16/bf16
  static constexpr int kStride = kUnit + kStagePad;
  static constexpr int kChunks = kUnit / 16;   // 16-byte chunks per unit
};
constexpr int kStageBytes = kTileThreads * StagedSlot<F32>::kStride;  // one block's slots

// One lane's unit of a staged step: an interior unit goes into the lane's slot (returns its
// address, written out by the warp), any other unit is stored directly (returns 0).
template <class Cfg, DistKind K, class T, class Slots, class Sink>
MM_HD uintptr_t stage_unit(const Segment& s, int64_t u, unsigned char* slot_bytes,
                           const Slots& slots, Sink& direct) {
  const UnitPos p = unit_pos<T::kSize>(s, u);
  const uintptr_t a = p.row + static_cast<uintptr_t>(p.cb * T::kSize);
  if (p.cb >= 0 && p.cb + 32 <= s.cols && (a & 15) == 0) {
    auto slot = slots.template make<T>(slot_bytes, a);
    interior_unit<Cfg, K, T>(s, p, a, slot);
    return a;
  }
  edge_unit<Cfg, K, T>(s, p, a, direct);
  return 0;
}

// One lane's share of the warp's write-out: 16-byte chunk 32 i + lane of the warp's slots.
template <class T, class Store>
MM_HD void write_out_lane(int warp0, int lane, const unsigned char* stage,
                          const uintptr_t* staged_at, const Store& store) {
  using Slot = StagedSlot<T>;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < Slot::kChunks; ++i) {
    const int c = i * kWarpSize + lane, unit = warp0 + c / Slot::kChunks;
    const int off = (c % Slot::kChunks) * 16;
    const uintptr_t dst = staged_at[unit];
    if (dst != 0) store.chunk16(dst + off, stage + unit * Slot::kStride + off);
  }
}

// Warp `warp0 / 32` of the block running `tile` (counted within s); `stage` and `staged_at`
// are the block's (kStageBytes, kTileThreads entries). Every lane runs the loop equally often:
// the warp's units are consecutive, so its first unit decides when it ends.
template <class Cfg, DistKind K, class T, class W, class Slots, class Sink, class Store>
MM_HD void run_warp_staged(const Segment& s, int64_t tile, int warp0, const W& w,
                           unsigned char* stage, uintptr_t* staged_at, const Slots& slots,
                           Sink& direct, const Store& store) {
  using Slot = StagedSlot<T>;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int k = 0; k < kUnitsPerThread; ++k) {
    const int64_t u0 = tile * kTile + warp0 + int64_t{k} * kTileThreads;
    if (u0 >= s.launch.units) return;
    w.lanes([&](int lane) {
      const int64_t u = u0 + lane;
      staged_at[warp0 + lane] =
          u < s.launch.units
              ? stage_unit<Cfg, K, T>(s, u, stage + (warp0 + lane) * Slot::kStride, slots, direct)
              : 0;
    });
    w.sync();
    w.lanes([&](int lane) { write_out_lane<T>(warp0, lane, stage, staged_at, store); });
    w.sync();  // the slots and addresses are rewritten by the next units
  }
}

// A warp's units of one (dtype, distribution): fp64 keeps its own stores (256-byte units).
template <class Cfg, class T, DistKind K, class W, class Slots, class Sink, class Store>
MM_HD void run_warp_fixed(const Segment& s, int64_t tile, int warp0, const W& w,
                          unsigned char* stage, uintptr_t* staged_at, const Slots& slots,
                          Sink& direct, const Store& store) {
  if constexpr (std::is_same_v<T, F64>) {
    w.lanes([&](int lane) { run_thread<Cfg, K, F64>(s, tile, warp0 + lane, direct); });
  } else {
    run_warp_staged<Cfg, K, T>(s, tile, warp0, w, stage, staged_at, slots, direct, store);
  }
}

template <class Cfg, class T, class W, class Slots, class Sink, class Store>
MM_HD void run_warp_staged_dist(const Segment& s, int64_t tile, int warp0, const W& w,
                                unsigned char* stage, uintptr_t* staged_at, const Slots& slots,
                                Sink& direct, const Store& store) {
  switch (static_cast<DistKind>(s.dist.kind)) {
    case DistKind::kUniform:
      return run_warp_fixed<Cfg, T, DistKind::kUniform>(s, tile, warp0, w, stage, staged_at,
                                                         slots, direct, store);
    case DistKind::kNormal:
      return run_warp_fixed<Cfg, T, DistKind::kNormal>(s, tile, warp0, w, stage, staged_at,
                                                        slots, direct, store);
    case DistKind::kTruncNormal:
      return run_warp_fixed<Cfg, T, DistKind::kTruncNormal>(s, tile, warp0, w, stage,
                                                             staged_at, slots, direct, store);
    case DistKind::kConstant:
      return run_warp_fixed<Cfg, T, DistKind::kConstant>(s, tile, warp0, w, stage, staged_at,
                                                          slots, direct, store);
  }
}

// Entry point of one warp: dtype and distribution are uniform over the block (one segment).
template <class Cfg, class W, class Slots, class Sink, class Store>
MM_HD void run_warp_any(const Segment& s, int64_t tile, int warp0, const W& w,
                        unsigned char* stage, uintptr_t* staged_at, const Slots& slots,
                        Sink& direct, const Store& store) {
  switch (static_cast<DType>(s.dtype)) {
    case DType::kFloat32:
      return run_warp_staged_dist<Cfg, F32>(s, tile, warp0, w, stage, staged_at, slots, direct,
                                            store);
    case DType::kFloat16:
      return run_warp_staged_dist<Cfg, F16>(s, tile, warp0, w, stage, staged_at, slots, direct,
                                            store);
    case DType::kBFloat16:
      return run_warp_staged_dist<Cfg, BF16>(s, tile, warp0, w, stage, staged_at, slots, direct,
                                             store);
    case DType::kFloat64:  // 256-byte units: their own stores
      return w.lanes(
          [&](int lane) { run_thread_dist<Cfg, F64>(s, tile, warp0 + lane, direct); });
    default:
      return;  // validated by prepare_launch
  }
}

}  // namespace metamat
