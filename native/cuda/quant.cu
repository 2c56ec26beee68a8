// Launchers of the quantization kernels (kernels_quant.cuh).
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels_quant.cuh"
#include "trainstream/common.h"
#include "trainstream/cuda_check.h"
#include "trainstream/quant.h"

namespace trainstream {
namespace {

using quant_gpu::BF16;
using quant_gpu::Half;

void check(const QuantArgs& a) {
  TS_CHECK_ARG(a.block_size >= 2 && a.block_size % 2 == 0, "block_size must be an even integer >= 2");
  TS_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16,
               "dtype must be float32, bfloat16 or float16");
}

// Enough resident blocks to fill the GPU; kernels loop grid-stride over the rest.
unsigned grid_for(int64_t threads_wanted, int device) {
  int sms = 0;
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks = (threads_wanted + 255) / 256;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * 8)));
}

// One thread per wanted thread (the kernels still loop grid-stride, so the cap only bounds the
// grid's size). For the dequantize fast path, warps that each handle exactly one step ran
// faster on an H200 than warps looping over a grid of 8 blocks per SM (see store8's note).
unsigned grid_full(int64_t threads_wanted) {
  const int64_t blocks = (threads_wanted + 255) / 256;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(1) << 30)));
}

}  // namespace

template <typename T>
static void quantize_typed(const QuantArgs& a, int device, cudaStream_t stream) {
  const bool nf4 = a.format == QuantFormat::kNF4;
  const int64_t bs = a.block_size;
  const int64_t blocks = (a.numel + bs - 1) / bs;
  const bool fast = bs >= 8 && bs <= 256 && (bs & (bs - 1)) == 0 &&
                    reinterpret_cast<uintptr_t>(a.values) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.codes) % (nf4 ? 4 : 8) == 0;
  int64_t first_block = 0;
  if (fast) {
    const int64_t steps = a.numel / quant_gpu::kQuantWarpStep;
    int log2 = 0;
    while ((int64_t(1) << log2) < bs) ++log2;
    if (steps > 0) {
      const unsigned grid = grid_for(steps * 32, device);
      if (nf4) quant_gpu::quantize_fast<T, true><<<grid, 256, 0, stream>>>(a, steps, log2);
      else quant_gpu::quantize_fast<T, false><<<grid, 256, 0, stream>>>(a, steps, log2);
      TS_CUDA_CHECK(cudaGetLastError());
    }
    first_block = steps * quant_gpu::kQuantWarpStep / bs;  // a warp step holds whole blocks
  }
  if (first_block < blocks) {
    const unsigned grid = grid_for((blocks - first_block) * 32, device);  // one warp per block
    if (nf4) quant_gpu::nf4_quantize_kernel<T><<<grid, 256, 0, stream>>>(a, first_block, blocks);
    else quant_gpu::int8_quantize_kernel<T><<<grid, 256, 0, stream>>>(a, first_block, blocks);
    TS_CUDA_CHECK(cudaGetLastError());
  }
}

void quantize_cuda(const QuantArgs& a, int device, int64_t stream_int) {
  check(a);
  if (a.numel == 0) return;
  DeviceGuard device_guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_int));
  switch (a.dtype) {
    case DType::kBFloat16: return quantize_typed<BF16>(a, device, stream);
    case DType::kFloat16: return quantize_typed<Half>(a, device, stream);
    default: return quantize_typed<float>(a, device, stream);
  }
}

template <typename T>
static void dequantize_typed(const QuantArgs& a, int device, cudaStream_t stream) {
  const bool nf4 = a.format == QuantFormat::kNF4;
  const int64_t bs = a.block_size;
  const bool pow2 = bs >= 8 && (bs & (bs - 1)) == 0;
  const bool aligned = reinterpret_cast<uintptr_t>(a.values) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(a.codes) % (nf4 ? 4 : 8) == 0;
  int64_t first_general = 0;
  if (pow2 && aligned) {
    const int64_t steps = a.numel / quant_gpu::kWarpStep;
    int log2 = 0;
    while ((int64_t(1) << log2) < bs) ++log2;
    if (steps > 0) {
      const unsigned grid = grid_full(steps * 32);
      if (nf4) quant_gpu::nf4_dequantize_fast<T><<<grid, 256, 0, stream>>>(a, steps, log2);
      else quant_gpu::int8_dequantize_fast<T><<<grid, 256, 0, stream>>>(a, steps, log2);
      TS_CUDA_CHECK(cudaGetLastError());
    }
    first_general = steps * quant_gpu::kWarpStep;
  }
  if (first_general < a.numel) {
    const unsigned grid = grid_for(nf4 ? (a.numel - first_general + 1) / 2 : a.numel - first_general, device);
    if (nf4) quant_gpu::nf4_dequantize_any<T><<<grid, 256, 0, stream>>>(a, first_general);
    else quant_gpu::int8_dequantize_any<T><<<grid, 256, 0, stream>>>(a, first_general);
    TS_CUDA_CHECK(cudaGetLastError());
  }
}

void dequantize_cuda(const QuantArgs& a, int device, int64_t stream_int) {
  check(a);
  if (a.numel == 0) return;
  DeviceGuard device_guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_int));
  switch (a.dtype) {
    case DType::kBFloat16: return dequantize_typed<BF16>(a, device, stream);
    case DType::kFloat16: return dequantize_typed<Half>(a, device, stream);
    default: return dequantize_typed<float>(a, device, stream);
  }
}

template <typename T, bool kNF4>
static void dequantize_batch_typed(const DequantTensor* tensors, int num_tensors, cudaStream_t stream) {
  static_assert(sizeof(quant_gpu::DequantBatch) <= 4096, "kernel arguments are limited to 4 KiB");
  quant_gpu::DequantBatch batch{};
  auto launch = [&] {
    if (batch.count == 0) return;
    const unsigned grid = grid_full(batch.steps * 32);  // one warp step per warp, as dequantize_typed
    quant_gpu::dequantize_batch_kernel<T, kNF4><<<grid, 256, 0, stream>>>(batch);
    TS_CUDA_CHECK(cudaGetLastError());
    batch.count = 0;
    batch.steps = 0;
  };
  for (int i = 0; i < num_tensors; ++i) {
    const DequantTensor& d = tensors[i];
    TS_CHECK_ARG(d.block_size >= 2 && d.block_size % 2 == 0 && d.block_size <= INT32_MAX,
                 "block_size must be an even integer >= 2");
    if (d.numel == 0) continue;
    const int64_t bs = d.block_size;
    // The per-tensor launch's choice of its fast path (dequantize_typed).
    const bool pow2 = bs >= 8 && (bs & (bs - 1)) == 0;
    const bool aligned = reinterpret_cast<uintptr_t>(d.values) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(d.codes) % (kNF4 ? 4 : 8) == 0;
    int log2 = -1;
    if (pow2 && aligned) {
      log2 = 0;
      while ((int64_t(1) << log2) < bs) ++log2;
    }
    quant_gpu::BatchTensor& t = batch.t[batch.count++];
    t.codes = d.codes;
    t.absmax = d.absmax;
    t.values = d.values;
    t.numel = d.numel;
    t.first_step = batch.steps;
    t.block_size = static_cast<int32_t>(bs);
    t.log2_block = log2;
    batch.steps += (d.numel + quant_gpu::kWarpStep - 1) / quant_gpu::kWarpStep;
    if (batch.count == quant_gpu::kDequantBatchMax) launch();
  }
  launch();
}

template <typename T>
static void dequantize_batch_format(QuantFormat format, const DequantTensor* tensors, int n, cudaStream_t stream) {
  if (format == QuantFormat::kNF4) dequantize_batch_typed<T, true>(tensors, n, stream);
  else dequantize_batch_typed<T, false>(tensors, n, stream);
}

void dequantize_batch_cuda(QuantFormat format, DType dtype, const DequantTensor* tensors, int num_tensors,
                           int device, int64_t stream_int) {
  TS_CHECK_ARG(format == QuantFormat::kNF4 || format == QuantFormat::kInt8, "format must be nf4 or int8");
  TS_CHECK_ARG(dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16,
               "dtype must be float32, bfloat16 or float16");
  TS_CHECK_ARG(num_tensors >= 0, "num_tensors must be >= 0");
  if (num_tensors == 0) return;
  DeviceGuard device_guard(device);
  auto stream = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream_int));
  switch (dtype) {
    case DType::kBFloat16: return dequantize_batch_format<BF16>(format, tensors, num_tensors, stream);
    case DType::kFloat16: return dequantize_batch_format<Half>(format, tensors, num_tensors, stream);
    default: return dequantize_batch_format<float>(format, tensors, num_tensors, stream);
  }
}

}  // namespace trainstream
