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

}  // namespace trainstream
