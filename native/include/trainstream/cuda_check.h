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


namespace trainstream {

// Makes `device` current for a launch and gives the caller's current device back on exit:
// the launchers run on the user's threads (optimizer.step(), the quantized fetch), whose
// current device torch and the user rely on.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) TS_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace trainstream
