// Host gradient accumulation: chunking onto the thread pool and the ISA choice.
#include <algorithm>

#include "trainstream/common.h"
#include "trainstream/grad.h"
#include "trainstream/simd.h"

namespace trainstream {

using AccumulateRangeSig = void(float*, const void*, int64_t, DType);
TS_DECLARE_SIMD(AccumulateRangeSig, accumulate_range);

namespace {
constexpr int64_t kChunk = int64_t(1) << 16;
}

std::shared_ptr<Job> accumulate_queue(ThreadPool& pool, const std::vector<float*>& dsts,
                                      const std::vector<const void*>& srcs,
                                      const std::vector<int64_t>& numels, DType src_dtype) {
  TS_CHECK_ARG(dsts.size() == srcs.size() && dsts.size() == numels.size(),
               "accumulate: dsts, srcs and numels must have the same length");
  TS_CHECK_ARG(src_dtype == DType::kFloat32 || src_dtype == DType::kBFloat16,
               "accumulate: source dtype must be float32 or bfloat16");
  struct Chunk {
    float* dst;
    const void* src;
    int64_t n;
  };
  const size_t elem = src_dtype == DType::kBFloat16 ? 2 : 4;
  std::vector<Chunk> chunks;
  std::vector<const void*> keys;
  for (size_t t = 0; t < dsts.size(); ++t) {
    TS_CHECK_ARG(numels[t] >= 0, "accumulate: numel must be >= 0");
    for (int64_t b = 0; b < numels[t]; b += kChunk)
      chunks.push_back({dsts[t] + b, static_cast<const char*>(srcs[t]) + b * elem,
                        std::min(kChunk, numels[t] - b)});
    keys.push_back(dsts[t]);
    keys.push_back(srcs[t]);
  }
  AccumulateRangeFn fn = TS_PICK_SIMD(accumulate_range);
  const int64_t n = static_cast<int64_t>(chunks.size());
  return pool.submit([fn, src_dtype, chunks = std::move(chunks)](int64_t c) {
    fn(chunks[c].dst, chunks[c].src, chunks[c].n, src_dtype);
  }, n, std::move(keys));
}

}  // namespace trainstream
