// Queries of the statically linked CUDA runtime. These never touch torch's CUDA state:
// the static cudart has its own, and libcuda.so.1 is loaded by it on first use, so a
// machine without a driver gets an error code here, not a failed import.
#include <cuda_runtime.h>

#include "trainstream/cuda_info.h"

namespace trainstream {

CudaInfo cuda_info() {
  CudaInfo info{CUDART_VERSION, 0, 0, ""};
  if (cudaDriverGetVersion(&info.driver_version) != cudaSuccess) info.driver_version = 0;
  cudaError_t err = cudaGetDeviceCount(&info.device_count);
  if (err != cudaSuccess) {
    info.device_count = 0;
    info.error = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
  }
  return info;
}

}  // namespace trainstream
