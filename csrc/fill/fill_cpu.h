// Internals of the CPU init engine shared by fill_cpu.cpp, the per-instruction-set kernels
// (fill_cpu_kernel.h, compiled as fill_cpu_{avx512,avx2,base}.cpp) and the bindings' test hook.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "metamat/fill.h"

namespace metamat {

// The simd_math.h functions the test hook exposes (in -> out element layouts in cpu_math).
enum class MathFn : int32_t { kLog, kSinCos, kBoxMuller, kErfinv, kToF16, kToBF16 };

#define MM_DECLARE_CPU_KERNEL(ns)                                                       \
  namespace ns {                                                                        \
  void fill_span(const Segment& s, int64_t begin, int64_t end);                         \
  void math_apply(MathFn fn, const void* in, void* out, int64_t n);                     \
  }
MM_DECLARE_CPU_KERNEL(isa_avx512)
MM_DECLARE_CPU_KERNEL(isa_avx2)
MM_DECLARE_CPU_KERNEL(isa_base)
#undef MM_DECLARE_CPU_KERNEL

// The CPU kernels this CPU can run, widest first ("avx512", "avx2", "x86-64"); fill_cpu picks
// one of them (cpu_kernel_name) and takes any of them as its `isa`.
std::vector<std::string> cpu_kernels_runnable();

// Test hook: run one transform of the CPU kernels over n inputs, with the kernel named by
// `isa` ("avx512", "avx2", "x86-64") or "scalar" (philox.h / dtype.h, the functions the
// kernels must equal bit for bit). `fn`: "log" and "erfinv" (float32 -> float32), "sincos"
// (uint32 word w -> float32 pairs sin, cos of 2*pi*(w >> 8)/2^24), "box_muller" (uint32
// pairs w0, w1 -> float32 pairs z0, z1), "f16" and "bf16" (float32 -> uint16 bits).
// Throws CoreError on an unknown name or an instruction set this CPU cannot run.
void cpu_math(const std::string& fn, const std::string& isa, const void* in, void* out,
              int64_t n);

}  // namespace metamat
