// Launcher of the fused cross-entropy row kernel (kernels_loss.cuh).
#include <cuda_runtime.h>

#include "kernels_loss.cuh"
#include "trainstream/common.h"
#include "trainstream/cuda_check.h"
#include "trainstream/loss_gpu.h"

namespace trainstream {

void cross_entropy_rows_launch(const CrossEntropyRows& a, int device, int64_t stream_int) {
  TS_CHECK_ARG(a.rows >= 0 && a.vocab >= 0, "cross_entropy_rows: rows and vocab must be >= 0");
  TS_CHECK_ARG(a.rows < (int64_t(1) << 31), "cross_entropy_rows: too many rows for one launch (one block per row)");
  // Rows that overlap would be written by two blocks at once.
  TS_CHECK_ARG(a.rows <= 1 || a.row_stride >= a.vocab, "cross_entropy_rows: row_stride must be >= vocab");
  if (a.rows == 0 || a.vocab == 0) return;
  DeviceGuard device_guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_int));
  const dim3 grid(static_cast<unsigned>(a.rows));
  switch (a.dtype) {
    case DType::kFloat32: loss_gpu::cross_entropy_rows<float><<<grid, loss_gpu::kThreads, 0, stream>>>(a); break;
    case DType::kBFloat16:
      loss_gpu::cross_entropy_rows<loss_gpu::BF16><<<grid, loss_gpu::kThreads, 0, stream>>>(a);
      break;
    case DType::kFloat16:
      loss_gpu::cross_entropy_rows<loss_gpu::Half><<<grid, loss_gpu::kThreads, 0, stream>>>(a);
      break;
    default: throw ArgumentError("cross_entropy_rows: dtype must be float32, bfloat16 or float16");
  }
  TS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainstream
