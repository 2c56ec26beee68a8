// Error checks for CUDA runtime calls and kernel launches (CUDA sources only).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define TS_CUDA_CHECK(expr)                                                                 \
  do {                                                                                      \
    cudaError_t ts_err_ = (expr);                                                           \
    if (ts_err_ != cudaSuccess)                                                             \
      throw std::runtime_error(std::string("CUDA error in ") + #expr + ": " +              \
                               cudaGetErrorString(ts_err_));                                \
  } while (0)

