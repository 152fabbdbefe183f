// The CPU fill kernel for the avx512 instruction set (flags set in CMakeLists.txt).
#define MM_ISA isa_avx512
#include "fill_cpu_kernel.h"
