// NF4 and int8 quantization kernels. The element numerics are quant_numerics.h's (shared
// with the CPU build); what is specific here is bitsandbytes' GPU arithmetic for NF4:
// the block's reciprocal is the hardware approximation (rcp.approx.ftz, as its
// --use_fast_math build computes it) and products flush denormals to zero, so codes and
// values are bit-identical to bitsandbytes' CUDA kernels.
#pragma once

#include <cstdint>

#include "trainstream/numerics.h"
#include "trainstream/quant.h"
#include "trainstream/quant_numerics.h"

namespace trainstream {
namespace quant_gpu {

struct Half { uint16_t bits; };
struct BF16 { uint16_t bits; };

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const BF16* p, int64_t i) { return num::bf16_to_float(p[i].bits); }
__device__ __forceinline__ float load(const Half* p, int64_t i) { return num::f16_to_float(p[i].bits); }

__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float mul_ftz(float a, float b) {
  float r;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ uint16_t to_bits(BF16, float v) { return num::bf16_rne(v); }
__device__ __forceinline__ uint16_t to_bits(Half, float v) { return num::f16_rne(v); }

// ---- quantize: one warp per block (grid-stride over blocks) ----------------------------

template <typename T>
__global__ void __launch_bounds__(256) nf4_quantize_kernel(QuantArgs a, int64_t num_blocks) {
  constexpr bool kFlush = !std::is_same<T, Half>::value;
  const T* x = static_cast<const T*>(a.values);
  uint8_t* packed = static_cast<uint8_t*>(a.codes);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; b < num_blocks; b += warps) {
    const int64_t start = b * a.block_size;
    const int64_t end = min(a.numel, start + a.block_size);
    float m = -3.40282347e38f;  // bitsandbytes reduces from -FLT_MAX; fmaxf skips NaN
    for (int64_t i = start + lane; i < end; i += 32) {
      float v = load(x, i);
      v = kFlush ? quant::flush_denormal(v) : v;
      m = fmaxf(m, fabsf(v));
    }
    m = warp_max(m);
    const float r = rcp_approx_ftz(m);
    for (int64_t j = start / 2 + lane; 2 * j < end; j += 32) {
      float x0 = load(x, 2 * j);
      float x1 = 2 * j + 1 < end ? load(x, 2 * j + 1) : 0.0f;
      x0 = kFlush ? quant::flush_denormal(x0) : x0;
      x1 = kFlush ? quant::flush_denormal(x1) : x1;
      packed[j] = uint8_t((quant::nf4_code(mul_ftz(x0, r)) << 4) | quant::nf4_code(mul_ftz(x1, r)));
    }
    if (lane == 0) a.absmax[b] = m;
  }
}

template <typename T>
__global__ void __launch_bounds__(256) int8_quantize_kernel(QuantArgs a, int64_t num_blocks) {
  const T* x = static_cast<const T*>(a.values);
  int8_t* q = static_cast<int8_t*>(a.codes);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t b = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; b < num_blocks; b += warps) {
    const int64_t start = b * a.block_size;
    const int64_t end = min(a.numel, start + a.block_size);
    float m = 0.0f;
    for (int64_t i = start + lane; i < end; i += 32) m = fmaxf(m, fabsf(load(x, i)));
    m = warp_max(m);
    const float r = __fdiv_rn(127.0f, m);
    for (int64_t i = start + lane; i < end; i += 32) q[i] = quant::int8_code(__fmul_rn(load(x, i), r));
    if (lane == 0) a.absmax[b] = m;
  }
}

// ---- dequantize ------------------------------------------------------------------------

__device__ __forceinline__ void store16(float* out, int64_t base, const float (&v)[16]) {
  float4* o = reinterpret_cast<float4*>(out + base);
#pragma unroll
  for (int k = 0; k < 4; ++k) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
}

template <typename T>
__device__ __forceinline__ void store16(T* out, int64_t base, const float (&v)[16]) {
  uint32_t w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = uint32_t(to_bits(T{}, v[2 * k])) | (uint32_t(to_bits(T{}, v[2 * k + 1])) << 16);
  uint4* o = reinterpret_cast<uint4*>(out + base);
  o[0] = make_uint4(w[0], w[1], w[2], w[3]);
  o[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// Fast path: 16 values per thread per step, for power-of-two block sizes >= 16 (one absmax
// per 16 values) and 16-byte-aligned output; `groups` = numel / 16.
template <typename T>
__global__ void __launch_bounds__(256) nf4_dequantize_fast(QuantArgs a, int64_t groups, int log2_groups_per_block) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) {
    const float levels[16] = TS_NF4_LEVELS;
    lut[threadIdx.x] = levels[threadIdx.x];
  }
  __syncthreads();
  const uint2* packed = static_cast<const uint2*>(a.codes);
  T* out = static_cast<T*>(a.values);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const uint2 p = packed[g];
    const float s = a.absmax[g >> log2_groups_per_block];
    float v[16];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t byte = ((k < 4 ? p.x : p.y) >> (8 * (k & 3))) & 0xffu;
      v[2 * k] = mul_ftz(lut[byte >> 4], s);
      v[2 * k + 1] = mul_ftz(lut[byte & 15u], s);
    }
    store16(out, g * 16, v);
  }
}

template <typename T>
__global__ void __launch_bounds__(256) int8_dequantize_fast(QuantArgs a, int64_t groups, int log2_groups_per_block) {
  const uint4* codes = static_cast<const uint4*>(a.codes);
  T* out = static_cast<T*>(a.values);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const uint4 c = codes[g];
    const float s = __fdiv_rn(a.absmax[g >> log2_groups_per_block], 127.0f);
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
    float v[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) v[k] = __fmul_rn(float(int8_t((w[k >> 2] >> (8 * (k & 3))) & 0xffu)), s);
    store16(out, g * 16, v);
  }
}

__device__ __forceinline__ void store1(float* out, int64_t i, float v) { out[i] = v; }
template <typename T>
__device__ __forceinline__ void store1(T* out, int64_t i, float v) { reinterpret_cast<uint16_t*>(out)[i] = to_bits(T{}, v); }

// General path: any even block size, any alignment; elements [first, numel).
template <typename T>
__global__ void __launch_bounds__(256) nf4_dequantize_any(QuantArgs a, int64_t first) {
  const float levels[16] = TS_NF4_LEVELS;
  const uint8_t* packed = static_cast<const uint8_t*>(a.codes);
  T* out = static_cast<T*>(a.values);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = first / 2 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; 2 * j < a.numel; j += stride) {
    const uint32_t byte = packed[j];
    const float s = a.absmax[(2 * j) / a.block_size];  // the pair never straddles a block
    store1(out, 2 * j, mul_ftz(levels[byte >> 4], s));
    if (2 * j + 1 < a.numel) store1(out, 2 * j + 1, mul_ftz(levels[byte & 15u], s));
  }
}

template <typename T>
__global__ void __launch_bounds__(256) int8_dequantize_any(QuantArgs a, int64_t first) {
  const int8_t* q = static_cast<const int8_t*>(a.codes);
  T* out = static_cast<T*>(a.values);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = first + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.numel; i += stride)
    store1(out, i, __fmul_rn(float(q[i]), __fdiv_rn(a.absmax[i / a.block_size], 127.0f)));
}

}  // namespace quant_gpu
}  // namespace trainstream
