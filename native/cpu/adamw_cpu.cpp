// Host AdamW: run-time ISA choice, per-tensor scalars and chunking onto the thread pool.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#include "trainstream/adamw.h"

namespace trainstream {

// Entry points of the builds of adamw_simd.cpp.
using AdamWRangeSig = void(const AdamWConfig&, const AdamWScalars&, const AdamWTensor&, int64_t, int64_t);
TS_DECLARE_SIMD(AdamWRangeSig, adamw_range);

AdamWScalars make_scalars(const AdamWConfig& cfg, const AdamWTensor& t) {
  // Same arithmetic as torch's single-tensor AdamW: bias corrections in double
  // (Python floats there), each scalar then used as fp32 by the element loop.
  const double step = static_cast<double>(t.step);
  const double bias_correction1 = 1.0 - std::pow(cfg.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(cfg.beta2, step);
  AdamWScalars s;
  s.decay = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  s.weight_decay = static_cast<float>(cfg.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - cfg.beta1);
  s.beta2 = static_cast<float>(cfg.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - cfg.beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  s.eps = static_cast<float>(cfg.eps);
  s.neg_step_size = static_cast<float>(-(cfg.lr / bias_correction1));
  s.grad_scale = static_cast<float>(cfg.grad_scale);
  s.rng_key = rng_key(t.seed, t.step);
  return s;
}

static void check_config(const AdamWConfig& cfg) {
  TS_CHECK_ARG(cfg.grad_dtype == DType::kFloat32 || cfg.grad_dtype == DType::kBFloat16,
               "grad dtype must be float32 or bfloat16");
  TS_CHECK_ARG(cfg.moment_dtype == DType::kFloat32 || cfg.moment_dtype == DType::kBFloat16,
               "moment dtype must be float32 or bfloat16");
  TS_CHECK_ARG(cfg.copy_dtype == DType::kNone || cfg.copy_dtype == DType::kBFloat16 ||
                   cfg.copy_dtype == DType::kFloat16,
               "param copy dtype must be none, bfloat16 or float16");
}

std::shared_ptr<Job> adamw_queue(ThreadPool& pool, const AdamWConfig& cfg,
                                 std::vector<AdamWTensor> tensors, int64_t priority) {
  check_config(cfg);
  struct Chunk {
    int32_t tensor;
    int64_t begin, end;
  };
  std::vector<AdamWScalars> scalars;
  std::vector<Chunk> chunks;
  std::vector<const void*> keys;
  scalars.reserve(tensors.size());
  for (size_t ti = 0; ti < tensors.size(); ++ti) {
    const AdamWTensor& t = tensors[ti];
    TS_CHECK_ARG(t.numel >= 0, "numel must be >= 0");
    TS_CHECK_ARG(t.step >= 1, "step must be >= 1");
    TS_CHECK_ARG(t.numel == 0 || (t.param && t.grad && t.exp_avg && t.exp_avg_sq),
                 "null pointer for a non-empty tensor");
    TS_CHECK_ARG(t.numel == 0 || (cfg.copy_dtype == DType::kNone) == (t.param_copy == nullptr),
                 "param_copy must be given exactly when a copy dtype is set");
    scalars.push_back(make_scalars(cfg, t));
    for (int64_t b = 0; b < t.numel; b += kAdamWChunk)
      chunks.push_back({static_cast<int32_t>(ti), b, std::min(t.numel, b + kAdamWChunk)});
    // Every buffer the update touches orders this job after earlier jobs on it.
    keys.push_back(t.param);
    keys.push_back(t.grad);
    keys.push_back(t.exp_avg);
    keys.push_back(t.exp_avg_sq);
    if (t.param_copy) keys.push_back(t.param_copy);
  }
  AdamWRangeFn fn = TS_PICK_SIMD(adamw_range);
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  return pool.submit(
      [cfg, fn, tensors = std::move(tensors), scalars = std::move(scalars),
       chunks = std::move(chunks)](int64_t c) {
        const Chunk& ch = chunks[c];
        fn(cfg, scalars[ch.tensor], tensors[ch.tensor], ch.begin, ch.end);
      },
      num_chunks, std::move(keys), priority);
}

}  // namespace trainstream
