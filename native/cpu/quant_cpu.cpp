// Host quantization: chunks of whole blocks on the thread pool, ISA chosen at run time.
#include <algorithm>

#include "trainstream/common.h"
#include "trainstream/quant.h"
#include "trainstream/simd.h"

namespace trainstream {

TS_DECLARE_SIMD(QuantizeBlocksSig, quantize_blocks);
TS_DECLARE_SIMD(DequantizeRangeSig, dequantize_range);

namespace {

constexpr int64_t kChunkElements = int64_t(1) << 16;

void check(const QuantArgs& a) {
  TS_CHECK_ARG(a.block_size >= 2 && a.block_size % 2 == 0, "block_size must be an even integer >= 2");
  TS_CHECK_ARG(a.numel >= 0, "numel must be >= 0");
  TS_CHECK_ARG(a.dtype == DType::kFloat32 || a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16,
               "dtype must be float32, bfloat16 or float16");
}

int64_t blocks_per_chunk(int64_t block_size) { return std::max<int64_t>(1, kChunkElements / block_size); }

}  // namespace

std::shared_ptr<Job> quantize_queue(ThreadPool& pool, const QuantArgs& a) {
  check(a);
  const int64_t blocks = (a.numel + a.block_size - 1) / a.block_size;
  const int64_t per = blocks_per_chunk(a.block_size);
  auto fn = TS_PICK_SIMD(quantize_blocks);
  return pool.submit(
      [a, fn, per, blocks](int64_t c) { fn(a, c * per, std::min(blocks, (c + 1) * per)); },
      (blocks + per - 1) / per, {a.codes, a.absmax, a.values});
}

std::shared_ptr<Job> dequantize_queue(ThreadPool& pool, const QuantArgs& a) {
  check(a);
  const int64_t span = blocks_per_chunk(a.block_size) * a.block_size;  // whole blocks per chunk
  auto fn = TS_PICK_SIMD(dequantize_range);
  return pool.submit(
      [a, fn, span](int64_t c) { fn(a, c * span, std::min(a.numel, (c + 1) * span)); },
      (a.numel + span - 1) / span, {a.codes, a.absmax, a.values});
}

}  // namespace trainstream
