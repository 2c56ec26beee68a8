// NF4 and int8 quantization kernels. The element numerics are quant_numerics.h's (shared
// with the CPU build); what is specific here is bitsandbytes' GPU arithmetic for NF4:
// the block's reciprocal is the hardware approximation (rcp.approx.ftz, as its
// --use_fast_math build computes it) and products flush denormals to zero, so codes and
// values are bit-identical to bitsandbytes' CUDA kernels.
#pragma once

#include <cstdint>
#include <type_traits>

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

// ---- quantize --------------------------------------------------------------------------
//
// General path: one warp per block (grid-stride over blocks), any even block size.

template <typename T>
__global__ void __launch_bounds__(256) nf4_quantize_kernel(QuantArgs a, int64_t first_block, int64_t num_blocks) {
  constexpr bool kFlush = !std::is_same<T, Half>::value;
  const T* x = static_cast<const T*>(a.values);
  uint8_t* packed = static_cast<uint8_t*>(a.codes);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t b = first_block + ((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5); b < num_blocks; b += warps) {
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
__global__ void __launch_bounds__(256) int8_quantize_kernel(QuantArgs a, int64_t first_block, int64_t num_blocks) {
  const T* x = static_cast<const T*>(a.values);
  int8_t* q = static_cast<int8_t*>(a.codes);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t b = first_block + ((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5); b < num_blocks; b += warps) {
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

// Fast path, for power-of-two block sizes 8..256 and aligned buffers: each lane loads 8
// consecutive values with 16-byte loads (two slices of 256 values per warp step, so two
// loads in flight), the bs/8 lanes of a block reduce its absmax with shuffles, and each
// lane stores its 8 codes in one 4-byte (NF4) or 8-byte (int8) store.

__device__ __forceinline__ void load8(const float* x, int64_t i, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(x + i);
  const float4 b = *reinterpret_cast<const float4*>(x + i + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void load8(const T* x, int64_t i, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(x + i);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = load(reinterpret_cast<const T*>(&w[k >> 1]) + (k & 1), 0);
}

constexpr int kQuantSlices = 2;
constexpr int64_t kQuantWarpStep = 256 * kQuantSlices;

__device__ __forceinline__ float group_max(float m, int lanes_per_block) {
  for (int o = 1; o < lanes_per_block; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// `steps` = numel / kQuantWarpStep; the caller quantizes the remaining blocks with the general path.
template <typename T, bool kNF4>
__global__ void __launch_bounds__(256) quantize_fast(QuantArgs a, int64_t steps, int log2_block) {
  constexpr bool kFlush = kNF4 && !std::is_same<T, Half>::value;
  const T* x = static_cast<const T*>(a.values);
  const int lane = threadIdx.x & 31;
  const int lanes_per_block = int(a.block_size >> 3);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; w < steps; w += warps) {
    float v[kQuantSlices][8];
#pragma unroll
    for (int k = 0; k < kQuantSlices; ++k) load8(x, w * kQuantWarpStep + k * 256 + lane * 8, v[k]);
#pragma unroll
    for (int k = 0; k < kQuantSlices; ++k) {
      const int64_t first = w * kQuantWarpStep + k * 256 + lane * 8;
      float m = kNF4 ? -3.40282347e38f : 0.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (kFlush) v[k][e] = quant::flush_denormal(v[k][e]);
        m = fmaxf(m, fabsf(v[k][e]));
      }
      m = group_max(m, lanes_per_block);
      if ((lane & (lanes_per_block - 1)) == 0) a.absmax[first >> log2_block] = m;
      if (kNF4) {
        const float r = rcp_approx_ftz(m);
        uint32_t word = 0;
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          const uint32_t byte = (quant::nf4_code(mul_ftz(v[k][e], r)) << 4) | quant::nf4_code(mul_ftz(v[k][e + 1], r));
          word |= byte << (4 * e);
        }
        static_cast<uint32_t*>(a.codes)[first >> 3] = word;
      } else {
        const float r = __fdiv_rn(127.0f, m);
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const uint32_t q = uint8_t(quant::int8_code(__fmul_rn(v[k][e], r)));
          if (e < 4) lo |= q << (8 * e); else hi |= q << (8 * (e - 4));
        }
        static_cast<uint2*>(a.codes)[first >> 3] = make_uint2(lo, hi);
      }
    }
  }
}

// ---- dequantize ------------------------------------------------------------------------
//
// Fast path, for power-of-two block sizes >= 8 and aligned buffers: a warp covers 512
// values per step; lane l owns values [8l, 8l + 8) of each of the step's two 256-value
// slices, so every load (4 bytes of NF4 codes or 8 of int8 per lane) and every 16-byte
// store is coalesced across the warp, and each lane has two independent loads in flight.
// Eight values never straddle a block, so each needs one absmax. Two slices ran 2% faster
// on an H200 than four, and 5-9% faster than one or eight (standalone NF4 experiment,
// 3 shapes, one warp step per warp).

constexpr int kSlices = 2;                    // 256-value slices per warp step
constexpr int64_t kWarpStep = 256 * kSlices;  // values per warp step

__device__ __forceinline__ void store8(float* out, int64_t base, const float (&v)[8]) {
  // Streaming stores: this kernel never reads its output back. With read-only loads and the
  // dequantize's one-step-per-warp grid (quant.cu), 4-8% faster on an H200 than plain stores
  // and loads on a capped grid (standalone experiment, 3 shapes); the grid was most of it.
  float4* o = reinterpret_cast<float4*>(out + base);
  __stcs(o, make_float4(v[0], v[1], v[2], v[3]));
  __stcs(o + 1, make_float4(v[4], v[5], v[6], v[7]));
}

// Two values rounded to nearest even and packed, first in the low half. One hardware
// conversion on sm_80+ (the same rounding as bitsandbytes' kernels, which matters for
// throughput: the conversion is most of a dequantize's arithmetic); bit operations before.
__device__ __forceinline__ uint32_t pack2(BF16, float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return uint32_t(num::bf16_rne(lo)) | (uint32_t(num::bf16_rne(hi)) << 16);
#endif
}

__device__ __forceinline__ uint32_t pack2(Half, float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return uint32_t(num::f16_rne(lo)) | (uint32_t(num::f16_rne(hi)) << 16);
#endif
}

template <typename T>
__device__ __forceinline__ void store8(T* out, int64_t base, const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = pack2(T{}, v[2 * k], v[2 * k + 1]);
  __stcs(reinterpret_cast<uint4*>(out + base), make_uint4(w[0], w[1], w[2], w[3]));
}

// `steps` = numel / kWarpStep whole warp steps; the caller handles the rest with the general path.
template <typename T>
__global__ void __launch_bounds__(256) nf4_dequantize_fast(QuantArgs a, int64_t steps, int log2_block) {
  __shared__ float lut[16];
  if (threadIdx.x < 16) {
    const float levels[16] = TS_NF4_LEVELS;
    lut[threadIdx.x] = levels[threadIdx.x];
  }
  __syncthreads();
  const uint32_t* packed = static_cast<const uint32_t*>(a.codes);
  T* out = static_cast<T*>(a.values);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; w < steps; w += warps) {
    uint32_t p[kSlices];
    float s[kSlices];
#pragma unroll
    for (int k = 0; k < kSlices; ++k) {
      const int64_t first = w * kWarpStep + k * 256 + lane * 8;  // first of this lane's 8 values
      p[k] = __ldg(packed + (first >> 3));
      s[k] = __ldg(a.absmax + (first >> log2_block));
    }
#pragma unroll
    for (int k = 0; k < kSlices; ++k) {
      float v[8];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (p[k] >> (8 * b)) & 0xffu;
        v[2 * b] = mul_ftz(lut[byte >> 4], s[k]);
        v[2 * b + 1] = mul_ftz(lut[byte & 15u], s[k]);
      }
      store8(out, w * kWarpStep + k * 256 + lane * 8, v);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256) int8_dequantize_fast(QuantArgs a, int64_t steps, int log2_block) {
  const uint2* codes = static_cast<const uint2*>(a.codes);
  T* out = static_cast<T*>(a.values);
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; w < steps; w += warps) {
    uint2 c[kSlices];
    float s[kSlices];
#pragma unroll
    for (int k = 0; k < kSlices; ++k) {
      const int64_t first = w * kWarpStep + k * 256 + lane * 8;
      c[k] = __ldg(codes + (first >> 3));
      s[k] = __fdiv_rn(__ldg(a.absmax + (first >> log2_block)), 127.0f);
    }
#pragma unroll
    for (int k = 0; k < kSlices; ++k) {
      float v[8];
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const uint32_t word = b < 4 ? c[k].x : c[k].y;
        v[b] = __fmul_rn(float(int8_t((word >> (8 * (b & 3))) & 0xffu)), s[k]);
      }
      store8(out, w * kWarpStep + k * 256 + lane * 8, v);
    }
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


// ---- batched dequantize ----------------------------------------------------------------
//
// A unit's quantized weights in one launch. Each tensor is cut into warp steps of kWarpStep
// values, as the per-tensor launch cuts it; a warp takes one step of one tensor (the batch
// is a kernel argument, looked up by the step's index). A whole step of a tensor the
// per-tensor launch would give its fast path (log2_block >= 0: power-of-two block >= 8,
// aligned buffers) runs that path's arithmetic; every other step (a tensor's tail, or any
// step of an ineligible tensor) runs the general path's. So each value is computed by the
// same operations as in dequantize_cuda, and its bits are the same.

constexpr int kDequantBatchMax = 64;  // tensors per launch: the argument (3 KiB) stays within 4 KiB

struct BatchTensor {
  const void* codes;
  const float* absmax;
  void* values;
  int64_t numel;
  int64_t first_step;  // the batch's steps before this tensor's
  int32_t block_size;
  int32_t log2_block;  // -1: the general path for every step
};

struct DequantBatch {
  int32_t count;
  int64_t steps;  // all tensors' steps
  BatchTensor t[kDequantBatchMax];
};

template <typename T, bool kNF4>
__global__ void __launch_bounds__(256) dequantize_batch_kernel(const DequantBatch batch) {
  __shared__ float lut[16];
  if (kNF4 && threadIdx.x < 16) {
    const float levels[16] = TS_NF4_LEVELS;
    lut[threadIdx.x] = levels[threadIdx.x];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t g = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; g < batch.steps; g += warps) {
    int lo = 0, hi = batch.count - 1;  // the last tensor whose first step is <= g
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (batch.t[mid].first_step <= g) lo = mid;
      else hi = mid - 1;
    }
    const BatchTensor& d = batch.t[lo];
    const int64_t base = (g - d.first_step) * kWarpStep;
    T* out = static_cast<T*>(d.values);
    if (d.log2_block >= 0 && base + kWarpStep <= d.numel) {
      float v[kSlices][8];
#pragma unroll
      for (int k = 0; k < kSlices; ++k) {
        const int64_t first = base + k * 256 + lane * 8;
        const float s = __ldg(d.absmax + (first >> d.log2_block));
        if (kNF4) {
          const uint32_t p = __ldg(static_cast<const uint32_t*>(d.codes) + (first >> 3));
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const uint32_t byte = (p >> (8 * b)) & 0xffu;
            v[k][2 * b] = mul_ftz(lut[byte >> 4], s);
            v[k][2 * b + 1] = mul_ftz(lut[byte & 15u], s);
          }
        } else {
          const uint2 c = __ldg(static_cast<const uint2*>(d.codes) + (first >> 3));
          const float scale = __fdiv_rn(s, 127.0f);
#pragma unroll
          for (int b = 0; b < 8; ++b) {
            const uint32_t word = b < 4 ? c.x : c.y;
            v[k][b] = __fmul_rn(float(int8_t((word >> (8 * (b & 3))) & 0xffu)), scale);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kSlices; ++k) store8(out, base + k * 256 + lane * 8, v[k]);
      continue;
    }
    const int64_t end = min(d.numel, base + kWarpStep);
    if (kNF4) {
      const uint8_t* packed = static_cast<const uint8_t*>(d.codes);
      for (int64_t j = base / 2 + lane; 2 * j < end; j += 32) {
        const uint32_t byte = packed[j];
        const float s = d.absmax[(2 * j) / d.block_size];  // the pair never straddles a block
        store1(out, 2 * j, mul_ftz(lut[byte >> 4], s));
        if (2 * j + 1 < end) store1(out, 2 * j + 1, mul_ftz(lut[byte & 15u], s));
      }
    } else {
      const int8_t* q = static_cast<const int8_t*>(d.codes);
      for (int64_t i = base + lane; i < end; i += 32)
        store1(out, i, __fmul_rn(float(q[i]), __fdiv_rn(d.absmax[i / d.block_size], 127.0f)));
    }
  }
}

}  // namespace quant_gpu
}  // namespace trainstream
