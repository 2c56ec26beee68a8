// The zero-copy CUDA AdamW: gradients and the weights the model reads are in VRAM; the fp32
// master weights and both moments stay in pinned host memory, which the kernel reads and
// writes directly over PCIe (mapped memory under unified addressing), one pass per element.
#pragma once

#include <cstdint>

#include "trainstream/dtype.h"

namespace trainstream {

// One tensor of a launch, as Python packs it into an int64[8] row (see ops/adamw_gpu.py).
struct GpuAdamWTensor {
  int64_t master;       // host fp32 master weights, or 0: the fp32 GPU param is the master
  int64_t grad;         // device
  int64_t exp_avg;      // host (pinned)
  int64_t exp_avg_sq;   // host (pinned)
  int64_t param;        // device: the weights the model reads, written with the new values
  int64_t numel;
  int64_t first_chunk;  // index of this tensor's first chunk in the launch
  int64_t rng_key;      // stochastic-rounding key for this step (uint32)
};

// Per-tensor scalars, a float32[10] row: AdamWScalars' fields in order, then padding.
constexpr int kGpuScalarFields = 10;

constexpr int64_t kGpuAdamWChunk = int64_t(1) << 14;  // elements per thread block

struct GpuAdamWLaunch {
  const GpuAdamWTensor* tensors;  // device
  const float* scalars;           // device, [num_tensors][kGpuScalarFields]
  const float* grad_scale;        // device scalar multiplied into every gradient, or nullptr
  // Device int32, or nullptr: when it holds a non-zero value the kernel returns without
  // writing anything (the non-finite check set it earlier on the stream, grad_gpu.h).
  const int32_t* skip_flag;
  // Device int32 per tensor of the launch, or nullptr: a tensor whose entry is non-zero is
  // skipped (its params, masters and moments keep their bits), the others update as without
  // it. The device state's check decides it per unit without a host sync (device_state.py).
  const int32_t* tensor_skip;
  int num_tensors;
  int64_t num_chunks;
  // At most this many thread blocks, each looping over chunks (0: one block per chunk).
  // Beside backward, a small grid leaves most SMs to the GEMMs: the kernel waits on PCIe,
  // and a few SMs keep enough loads in flight to fill it.
  int64_t max_blocks;
  bool decoupled;
  DType grad_dtype;    // float32 or bfloat16
  DType moment_dtype;  // float32 or bfloat16
  DType param_dtype;   // float32, bfloat16 or float16
  int device;
  int64_t stream;      // cudaStream_t as an integer (torch's current stream)
};

// Launches on the given stream and returns; throws std::runtime_error on a CUDA error.
void adamw_gpu_launch(const GpuAdamWLaunch& launch);

}  // namespace trainstream
