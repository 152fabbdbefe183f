// MM_CUDA_CHECK(expr): a CUDA runtime call whose failure throws through metamat::fail with
// the call's text and CUDA's message (one definition for every .cu file).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "metamat/check.h"

#define MM_CUDA_CHECK(expr)                                                                \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess)                                                               \
      ::metamat::fail(__FILE__, __LINE__,                                                  \
                      std::string(#expr) + " failed: " + cudaGetErrorString(err_));        \
  } while (0)
