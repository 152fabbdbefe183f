// The CPU fill kernel for the base instruction set (flags set in CMakeLists.txt).
#define MM_ISA isa_base
#include "fill_cpu_kernel.h"
