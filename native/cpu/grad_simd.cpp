// Gradient accumulation loop, compiled once per SIMD level (see simd.h). One fp32 add per
// element: the same result as torch's dst.add_(src) for fp32 and bf16 sources.
#include <cstdint>

#include "trainstream/dtype.h"
#include "trainstream/numerics.h"
#include "trainstream/simd.h"

namespace trainstream {
namespace {

void add_f32(float* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
}

void add_bf16(float* __restrict dst, const uint16_t* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = dst[i] + num::bf16_to_float(src[i]);
}

}  // namespace

void TS_ISA_FN(accumulate_range)(float* dst, const void* src, int64_t n, DType src_dtype) {
  if (src_dtype == DType::kBFloat16)
    add_bf16(dst, static_cast<const uint16_t*>(src), n);
  else
    add_f32(dst, static_cast<const float*>(src), n);
}

}  // namespace trainstream
