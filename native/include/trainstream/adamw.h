// Host AdamW: one fused pass per element over the fp32 master weight, the gradient,
// both moments and (optionally) a low-precision copy of the updated weight.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "trainstream/adamw_kernel.h"
#include "trainstream/common.h"
#include "trainstream/thread_pool.h"

namespace trainstream {

AdamWScalars make_scalars(const AdamWConfig& cfg, const AdamWTensor& t);

// SIMD levels, best last. "scalar" still lets the compiler use the baseline SSE2.
enum class SimdLevel : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
SimdLevel best_simd_level();          // what this CPU supports
SimdLevel active_simd_level();        // what the kernels use now
void set_simd_level(SimdLevel level); // for tests: force a lower level; ArgumentError if unsupported
const char* simd_name(SimdLevel level);

// Queues the update of every tensor on the pool and returns at once.
std::shared_ptr<Job> adamw_queue(ThreadPool& pool, const AdamWConfig& cfg,
                                 std::vector<AdamWTensor> tensors);

}  // namespace trainstream
