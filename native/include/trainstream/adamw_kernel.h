// What one ISA build of the AdamW kernel sees: plain structs and internal-linkage helpers.
// The SIMD kernel files are compiled with -mavx2 / -mavx512f; anything with external
// linkage included there could be merged by the linker into code that runs on CPUs
// without those instructions, so this header holds no inline function with external
// linkage and includes nothing from the standard library but <cstdint>.
#pragma once

#include <cstdint>

#include "trainstream/dtype.h"
#include "trainstream/numerics.h"

namespace trainstream {

// Per-call hyper-parameters (one optimizer param group).
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double grad_scale = 1.0;   // gradients are multiplied by this first (clipping, accumulation)
  bool decoupled = true;     // AdamW; false is Adam with L2 added to the gradient
  DType grad_dtype = DType::kFloat32;    // float32 or bfloat16
  DType moment_dtype = DType::kFloat32;  // float32 or bfloat16 (stochastic rounding)
  DType copy_dtype = DType::kNone;       // none, bfloat16 or float16
};

// One tensor of the call. The step is per tensor, as in torch.optim.AdamW.
struct AdamWTensor {
  float* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* param_copy;  // nullptr unless copy_dtype is set
  int64_t numel;
  int64_t step;      // the step being taken (1 on the first update)
  uint64_t seed;     // stochastic-rounding seed of this tensor
};

// Scalars one ISA kernel needs, derived once per tensor in double precision and
// rounded to float the way torch's CPU kernels round Python scalars.
struct AdamWScalars {
  float decay;          // 1 - lr * weight_decay (AdamW)
  float weight_decay;   // L2 coefficient (Adam)
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float grad_scale;
  uint32_t rng_key;     // derived from (seed, step); see rng_key()
};

// The stochastic-rounding key of one tensor at one step; element i then draws
// mix32(key ^ i). Twin: ops/reference.py's rng_key.
static inline uint32_t rng_key(uint64_t seed, int64_t step) {
  using num::mix32;
  uint32_t k = mix32(static_cast<uint32_t>(seed));
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = mix32(k ^ static_cast<uint32_t>(static_cast<uint64_t>(step)));
  k = mix32(k ^ static_cast<uint32_t>(static_cast<uint64_t>(step) >> 32));
  return k;
}

// Kernel entry of one ISA build: elements [begin, end) of one tensor.
// `begin` is a multiple of kChunk, so a range never straddles 2^32 elements.
using AdamWRangeFn = void (*)(const AdamWConfig&, const AdamWScalars&, const AdamWTensor&,
                              int64_t begin, int64_t end);

constexpr int64_t kAdamWChunk = int64_t(1) << 15;

}  // namespace trainstream
