// Per-tensor squared L2 norms of gradients on the GPU, for global-norm clipping before the
// gradients are copied to the host. Deterministic: a fixed two-pass reduction, no atomics.
#pragma once

#include <cstdint>

#include "trainstream/dtype.h"

namespace trainstream {

// One row per tensor, as Python packs it into int64[3]: data pointer, numel, first chunk.
struct SqNormTensor {
  int64_t data;
  int64_t numel;
  int64_t first_chunk;
};

constexpr int64_t kSqNormChunk = int64_t(1) << 13;  // elements per thread block, pass 1

// partials: device float[num_chunks] scratch; out: device float[num_tensors].
void grad_sq_norms_launch(const SqNormTensor* tensors, int num_tensors, int64_t num_chunks,
                          DType dtype, float* partials, float* out, int device, int64_t stream);

// The non-finite check before an update ([Note: non-finite gradients] in engine/grads.py).
// For every tensor holding a value that is not finite (NaN, +inf, -inf: read from the bits,
// so a finite value is never counted whatever its square), sets found[i] = 1 and *flag = 1;
// never clears either, and never writes the tensors. dtype: float32, bfloat16 or float16.
// found: int32[num_tensors] on the device or in pinned (mapped) host memory; flag: one
// int32 on the device, which later kernels on the stream read (the AdamW's skip_flag).
// max_blocks > 0 caps the grid (each block then loops over chunks), as beside backward.
void mark_nonfinite_launch(const SqNormTensor* tensors, int num_tensors, int64_t num_chunks, DType dtype,
                           int32_t* found, int32_t* flag, int64_t max_blocks, int device, int64_t stream);

}  // namespace trainstream
