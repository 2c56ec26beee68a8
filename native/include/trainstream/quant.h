// Blockwise quantization of frozen weights: NF4 (bitsandbytes' format) and int8
// (symmetric, absmax / 127 per block). Host kernels run on the thread pool; the CUDA
// kernels on a given stream.
//
// Layout, for n values and block size bs (any even number >= 2):
//   NF4:  packed uint8[ceil(n / 2)], element 2k in the high nibble of byte k;
//         absmax float32[ceil(n / bs)].
//   int8: codes int8[n]; absmax float32[ceil(n / bs)].
#pragma once

#include <cstdint>
#include <memory>

#include "trainstream/dtype.h"
#include "trainstream/thread_pool.h"

namespace trainstream {

enum class QuantFormat : int { kNF4 = 0, kInt8 = 1 };

struct QuantArgs {
  QuantFormat format;
  int64_t numel;
  int64_t block_size;
  DType dtype;        // of the full-precision side: input of quantize, output of dequantize
  void* values;       // full-precision values (read by quantize, written by dequantize)
  void* codes;        // packed NF4 bytes or int8 codes
  float* absmax;
};

// One tensor of a batched dequantize: `numel` values of a common dtype written at `values`
// from its codes and absmax, as dequantize_cuda would write them for it alone.
struct DequantTensor {
  const void* codes;
  const float* absmax;
  void* values;
  int64_t numel;
  int64_t block_size;  // any even number >= 2
};

// Host: split into chunks of whole blocks on the pool; returns the job at once.
std::shared_ptr<Job> quantize_queue(ThreadPool& pool, const QuantArgs& args);
std::shared_ptr<Job> dequantize_queue(ThreadPool& pool, const QuantArgs& args);

// CUDA: asynchronous on `stream` (a cudaStream_t as an integer).
void quantize_cuda(const QuantArgs& args, int device, int64_t stream);
void dequantize_cuda(const QuantArgs& args, int device, int64_t stream);
// Every tensor of `tensors` (one format, one value dtype) dequantized in one kernel launch
// (one per kDequantBatchMax tensors), each value bit-identical to dequantize_cuda's.
void dequantize_batch_cuda(QuantFormat format, DType dtype, const DequantTensor* tensors, int num_tensors,
                           int device, int64_t stream);

// Range kernels of one SIMD build (quant_simd.cpp): blocks [b0, b1) / elements [e0, e1),
// e0 a multiple of the block size.
using QuantizeBlocksSig = void(const QuantArgs&, int64_t b0, int64_t b1);
using DequantizeRangeSig = void(const QuantArgs&, int64_t e0, int64_t e1);

}  // namespace trainstream
