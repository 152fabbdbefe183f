// The CPU fill kernel for the avx2 instruction set (flags set in CMakeLists.txt).
#define MM_ISA isa_avx2
#include "fill_cpu_kernel.h"
