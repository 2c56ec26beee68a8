// Launcher of the squared-norm kernels (kernels_grad.cuh).
#include <cuda_runtime.h>

#include "kernels_grad.cuh"
#include "trainstream/common.h"
#include "trainstream/cuda_check.h"

namespace trainstream {

void grad_sq_norms_launch(const SqNormTensor* tensors, int num_tensors, int64_t num_chunks,
                          DType dtype, float* partials, float* out, int device, int64_t stream_int) {
  TS_CHECK_ARG(num_chunks < (int64_t(1) << 31), "too many chunks for one launch");
  if (num_tensors == 0) return;
  DeviceGuard device_guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_int));
  if (num_chunks > 0) {
    dim3 grid(static_cast<unsigned>(num_chunks));
    switch (dtype) {
      case DType::kFloat32: grad_gpu::chunk_sq_sums<float><<<grid, 256, 0, stream>>>(tensors, num_tensors, partials); break;
      case DType::kBFloat16: grad_gpu::chunk_sq_sums<uint16_t><<<grid, 256, 0, stream>>>(tensors, num_tensors, partials); break;
      case DType::kFloat16: grad_gpu::chunk_sq_sums<grad_gpu::Half><<<grid, 256, 0, stream>>>(tensors, num_tensors, partials); break;
      default: throw ArgumentError("grad_sq_norms: dtype must be float32, bfloat16 or float16");
    }
    TS_CUDA_CHECK(cudaGetLastError());
  }
  grad_gpu::tensor_sums<<<num_tensors, 256, 0, stream>>>(tensors, num_tensors, num_chunks, partials, out);
  TS_CUDA_CHECK(cudaGetLastError());
}

void mark_nonfinite_launch(const SqNormTensor* tensors, int num_tensors, int64_t num_chunks, DType dtype,
                           int32_t* found, int32_t* flag, int64_t max_blocks, int device, int64_t stream_int) {
  TS_CHECK_ARG(num_chunks < (int64_t(1) << 31), "too many chunks for one launch");
  TS_CHECK_ARG(max_blocks >= 0, "max_blocks must be >= 0");
  if (num_tensors == 0 || num_chunks == 0) return;  // nothing to read: nothing is marked
  DeviceGuard device_guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_int));
  const int64_t blocks = max_blocks > 0 && max_blocks < num_chunks ? max_blocks : num_chunks;
  dim3 grid(static_cast<unsigned>(blocks));
  switch (dtype) {
    case DType::kFloat32:
      grad_gpu::mark_nonfinite<uint32_t><<<grid, 256, 0, stream>>>(tensors, num_tensors, num_chunks, found, flag);
      break;
    case DType::kBFloat16:
      grad_gpu::mark_nonfinite<uint16_t><<<grid, 256, 0, stream>>>(tensors, num_tensors, num_chunks, found, flag);
      break;
    case DType::kFloat16:
      grad_gpu::mark_nonfinite<grad_gpu::Half><<<grid, 256, 0, stream>>>(tensors, num_tensors, num_chunks, found,
                                                                         flag);
      break;
    default: throw ArgumentError("mark_nonfinite: dtype must be float32, bfloat16 or float16");
  }
  TS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainstream
