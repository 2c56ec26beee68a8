// Shared definitions for the native core. Kept free of libtorch and of anything
// ISA-specific, because the SIMD kernel files include it under different -m flags.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "trainstream/dtype.h"

namespace trainstream {

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kNone: return "none";
  }
  return "unknown";
}

// Raised for arguments Python should have validated; pybind11 maps it to ValueError.
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

#define TS_CHECK_ARG(cond, msg)                                              \
  do {                                                                       \
    if (!(cond)) throw ::trainstream::ArgumentError(std::string(msg));       \
  } while (0)

}  // namespace trainstream
