// Host AdamW: one fused pass per element over the fp32 master weight, the gradient,
// both moments and (optionally) a low-precision copy of the updated weight.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "trainstream/adamw_kernel.h"
#include "trainstream/common.h"
#include "trainstream/simd.h"
#include "trainstream/thread_pool.h"

namespace trainstream {

AdamWScalars make_scalars(const AdamWConfig& cfg, const AdamWTensor& t);

// Queues the update of every tensor on the pool and returns at once (`priority`: see
// ThreadPool).
std::shared_ptr<Job> adamw_queue(ThreadPool& pool, const AdamWConfig& cfg,
                                 std::vector<AdamWTensor> tensors, int64_t priority = 0);

}  // namespace trainstream
