// What the CUDA side of the module was built with and what the machine offers.
// Available only when the module is built with CUDA (TS_WITH_CUDA).
#pragma once

#include <string>

namespace trainstream {

struct CudaInfo {
  int runtime_version;   // CUDART_VERSION the module was compiled and statically linked with
  int driver_version;    // 0 when no driver is loaded
  int device_count;      // 0 when no driver or no device
  std::string error;     // why device_count is 0, if it is
};

CudaInfo cuda_info();

}  // namespace trainstream
