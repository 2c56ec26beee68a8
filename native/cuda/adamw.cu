// Launcher of the zero-copy AdamW kernel (kernels_adamw.cuh).
#include <cuda_runtime.h>

#include "kernels_adamw.cuh"
#include "trainstream/common.h"
#include "trainstream/cuda_check.h"

namespace trainstream {

template <typename G, typename M>
static void launch_typed(const GpuAdamWLaunch& L, cudaStream_t stream) {
  const int64_t blocks = L.max_blocks > 0 && L.max_blocks < L.num_chunks ? L.max_blocks : L.num_chunks;
  dim3 grid(static_cast<unsigned>(blocks));
  if (L.decoupled)
    adamw_gpu::adamw_kernel<G, M, true><<<grid, 256, 0, stream>>>(L);
  else
    adamw_gpu::adamw_kernel<G, M, false><<<grid, 256, 0, stream>>>(L);
}

void adamw_gpu_launch(const GpuAdamWLaunch& L) {
  TS_CHECK_ARG(L.grad_dtype == DType::kFloat32 || L.grad_dtype == DType::kBFloat16,
               "grad dtype must be float32 or bfloat16");
  TS_CHECK_ARG(L.moment_dtype == DType::kFloat32 || L.moment_dtype == DType::kBFloat16,
               "moment dtype must be float32 or bfloat16");
  TS_CHECK_ARG(L.param_dtype == DType::kFloat32 || L.param_dtype == DType::kBFloat16 ||
                   L.param_dtype == DType::kFloat16,
               "param dtype must be float32, bfloat16 or float16");
  TS_CHECK_ARG(L.num_chunks < (int64_t(1) << 31), "too many chunks for one launch");
  TS_CHECK_ARG(L.max_blocks >= 0, "max_blocks must be >= 0");
  if (L.num_chunks == 0) return;
  // Our statically linked runtime keeps its own current device: always set it.
  DeviceGuard device_guard(L.device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(L.stream));
  const bool g16 = L.grad_dtype == DType::kBFloat16, m16 = L.moment_dtype == DType::kBFloat16;
  if (g16 && m16) launch_typed<uint16_t, uint16_t>(L, stream);
  else if (g16) launch_typed<uint16_t, float>(L, stream);
  else if (m16) launch_typed<float, uint16_t>(L, stream);
  else launch_typed<float, float>(L, stream);
  TS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace trainstream
