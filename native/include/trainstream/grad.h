// Gradient helpers on the host: accumulation of micro-batch gradients into fp32 sums.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "trainstream/dtype.h"
#include "trainstream/thread_pool.h"

namespace trainstream {

// dst[i] += float(src[i]) for every (dst, src, numel); dst float32, src float32 or bfloat16.
// Ordered after earlier pool jobs on the same buffers (see ThreadPool's keys).
std::shared_ptr<Job> accumulate_queue(ThreadPool& pool, const std::vector<float*>& dsts,
                                      const std::vector<const void*>& srcs,
                                      const std::vector<int64_t>& numels, DType src_dtype);

using AccumulateRangeFn = void (*)(float* dst, const void* src, int64_t n, DType src_dtype);

}  // namespace trainstream
