// The CUDA kernel's stores and warp: the policies of fill_unit_work.h for device code (device
// only): DeviceSink (a thread's own vector and scalar stores), SlotSink / DeviceSlots (an
// interior unit into its shared-memory slot), DeviceStore (the warp's write-out), DeviceWarp.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fill_warp_work.h"

namespace metamat {

// Two floats -> two fp16 / bf16 in one 32-bit word (low half = a), round to nearest even:
// one F2FP instruction; bit-exact with dtype.h's f32_to_f16 / f32_to_bf16 for non-NaN input.
__device__ __forceinline__ uint32_t pack2(F16, float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
__device__ __forceinline__ uint32_t pack2(BF16, float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t u;
  memcpy(&u, &h, 4);
  return u;
}
__device__ __forceinline__ uint16_t pack1(F16, float a) { return __half_as_ushort(__float2half_rn(a)); }
__device__ __forceinline__ uint16_t pack1(BF16, float a) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(a));
}

// One store with the variant's cache operator (fill_variant.h `store`): 0 st.global.wb (the
// measured kernel), 1 plain st.global, 2 st.global.cs (evict-first).
template <int kOp, class V>
__device__ __forceinline__ void store_op(V* p, V v) {
  if constexpr (kOp == 0) {
    __stwb(p, v);
  } else if constexpr (kOp == 2) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// The kernel's stores (the Sink of fill_unit_work.h): 128-bit (or 64-bit) vector stores.
template <int kOp = 0>
struct DeviceSinkT {
  template <class T, int N>
  __device__ __forceinline__ void vec(uintptr_t a, const float* f) const {
    if constexpr (std::is_same_v<T, F32>) {
#pragma unroll
      for (int k = 0; k < N; k += 4)
        store_op<kOp>(reinterpret_cast<float4*>(a + 4 * k), make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]));
    } else if constexpr (std::is_same_v<T, F64>) {
#pragma unroll
      for (int k = 0; k < N; k += 2)
        store_op<kOp>(reinterpret_cast<double2*>(a + 8 * k), make_double2(f[k], f[k + 1]));
    } else if constexpr (N == 8) {
      store_op<kOp>(reinterpret_cast<uint4*>(a), make_uint4(pack2(T{}, f[0], f[1]), pack2(T{}, f[2], f[3]),
                                                     pack2(T{}, f[4], f[5]), pack2(T{}, f[6], f[7])));
    } else {
      static_assert(N == 4, "16-bit vectors are 4 or 8 elements");
      store_op<kOp>(reinterpret_cast<uint2*>(a), make_uint2(pack2(T{}, f[0], f[1]), pack2(T{}, f[2], f[3])));
    }
  }
  template <class T>
  __device__ __forceinline__ void one(uintptr_t a, float v) const {
    if constexpr (std::is_same_v<T, F32>) {
      store_op<kOp>(reinterpret_cast<float*>(a), v);
    } else if constexpr (std::is_same_v<T, F64>) {
      store_op<kOp>(reinterpret_cast<double*>(a), static_cast<double>(v));
    } else {
      store_op<kOp>(reinterpret_cast<unsigned short*>(a), pack1(T{}, v));
    }
  }
  __device__ __forceinline__ void philox(int) const {}
};
using DeviceSink = DeviceSinkT<0>;

// An interior unit's vectors into its thread's slot of shared memory, at their offset in the
// unit (`base` is the unit's address), packed as DeviceSink packs them.
template <class T>
struct SlotSink {
  unsigned char* slot;
  uintptr_t base;
  template <class U, int N>
  __device__ __forceinline__ void vec(uintptr_t a, const float* f) const {
    static_assert(std::is_same_v<U, T>, "one dtype per slot");
    unsigned char* d = slot + (a - base);
    if constexpr (std::is_same_v<T, F32>) {
#pragma unroll
      for (int k = 0; k < N; k += 4)
        *reinterpret_cast<uint4*>(d + 4 * k) =
            make_uint4(__float_as_uint(f[k]), __float_as_uint(f[k + 1]),
                       __float_as_uint(f[k + 2]), __float_as_uint(f[k + 3]));
    } else {
      static_assert(N == 8, "interior 16-bit words are 8 elements");
      *reinterpret_cast<uint4*>(d) = make_uint4(pack2(T{}, f[0], f[1]), pack2(T{}, f[2], f[3]),
                                                pack2(T{}, f[4], f[5]), pack2(T{}, f[6], f[7]));
    }
  }
  template <class U>
  __device__ __forceinline__ void one(uintptr_t, float) const { __trap(); }  // edge units only
  __device__ __forceinline__ void philox(int) const {}
};

struct DeviceSlots {
  template <class T>
  __device__ __forceinline__ SlotSink<T> make(unsigned char* slot, uintptr_t base) const {
    return SlotSink<T>{slot, base};
  }
};

template <int kOp = 0>
struct DeviceStoreT {
  __device__ __forceinline__ void chunk16(uintptr_t dst, const unsigned char* src) const {
    store_op<kOp>(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(src));
  }
};
using DeviceStore = DeviceStoreT<0>;

// The calling thread is one lane; the warp's lanes run in parallel.
struct DeviceWarp {
  int lane;
  template <class F>
  __device__ __forceinline__ void lanes(F&& f) const { f(lane); }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
};

}  // namespace metamat
