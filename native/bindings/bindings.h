// Pieces of the _C module defined in other binding files.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace trainstream {

template <typename T>
T* as_ptr(int64_t address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

#ifdef TS_WITH_CUDA
void bind_cuda(pybind11::module_& m);  // cuda_bindings.cpp
#endif

}  // namespace trainstream
