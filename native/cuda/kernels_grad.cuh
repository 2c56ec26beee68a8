// Squared-norm reduction kernels. Both passes reduce in a fixed order (per-thread strided
// sums, then a warp-shuffle tree, then warp 0 over the warp sums), so the same inputs give
// the same bits on every run.
#pragma once

#include <cstdint>

#include "trainstream/grad_gpu.h"
#include "trainstream/numerics.h"

namespace trainstream {
namespace grad_gpu {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(uint16_t bits) { return num::bf16_to_float(bits); }
struct Half { uint16_t bits; };
__device__ __forceinline__ float to_float(Half h) { return num::f16_to_float(h.bits); }

// Sum over the block's 256 threads; the result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[8];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < 8 ? warp_sums[threadIdx.x] : 0.0f;
  if (threadIdx.x < 32) {
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

__device__ __forceinline__ int find_tensor(const SqNormTensor* t, int n, int64_t chunk) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (t[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
__global__ void __launch_bounds__(256) chunk_sq_sums(const SqNormTensor* tensors, int n, float* partials) {
  const int64_t chunk = blockIdx.x;
  const SqNormTensor t = tensors[find_tensor(tensors, n, chunk)];
  const T* x = reinterpret_cast<const T*>(t.data);
  const int64_t begin = (chunk - t.first_chunk) * kSqNormChunk;
  const int64_t end = min(t.numel, begin + kSqNormChunk);
  float acc = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float v = to_float(x[i]);
    acc += v * v;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[chunk] = acc;
}

__global__ void __launch_bounds__(256) tensor_sums(const SqNormTensor* tensors, int n, int64_t num_chunks,
                                                  const float* partials, float* out) {
  const int ti = blockIdx.x;
  const int64_t first = tensors[ti].first_chunk;
  const int64_t last = ti + 1 < n ? tensors[ti + 1].first_chunk : num_chunks;
  float acc = 0.0f;
  for (int64_t c = first + threadIdx.x; c < last; c += blockDim.x) acc += partials[c];
  acc = block_sum(acc);
  if (threadIdx.x == 0) out[ti] = acc;
}

// Bits of a value whose exponent is all ones: NaN or an infinity. U: the element's bits.
__device__ __forceinline__ bool nonfinite_bits(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }
__device__ __forceinline__ bool nonfinite_bits(uint16_t bits) { return (bits & 0x7f80u) == 0x7f80u; }  // bf16
__device__ __forceinline__ bool nonfinite_bits(Half h) { return (h.bits & 0x7c00u) == 0x7c00u; }

// The same test on a 32-bit word of U elements (one fp32, or two 16-bit values: the high
// one's exponent sits 16 bits up).
template <typename U> __device__ __forceinline__ bool nonfinite_word(uint32_t w);
template <> __device__ __forceinline__ bool nonfinite_word<uint32_t>(uint32_t w) { return nonfinite_bits(w); }
template <> __device__ __forceinline__ bool nonfinite_word<uint16_t>(uint32_t w) {
  return ((w & 0x7f80u) == 0x7f80u) | ((w & 0x7f800000u) == 0x7f800000u);
}
template <> __device__ __forceinline__ bool nonfinite_word<Half>(uint32_t w) {
  return ((w & 0x7c00u) == 0x7c00u) | ((w & 0x7c000000u) == 0x7c000000u);
}

// One chunk of one tensor per block and pass; a block that sees a non-finite value marks
// its tensor and the flag. Every writer writes 1, so the racing stores agree; the gradient
// is only read. 16-byte loads where the tensor is aligned (a chunk starts a multiple of
// kSqNormChunk elements in, so its start is too), then the elements past the last whole
// vector one by one.
template <typename U>
__global__ void __launch_bounds__(256) mark_nonfinite(const SqNormTensor* tensors, int n, int64_t num_chunks,
                                                     int32_t* found, int32_t* flag) {
  constexpr int64_t kPerVector = 16 / sizeof(U);
  for (int64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {  // uniform per block
    const int ti = find_tensor(tensors, n, chunk);
    const SqNormTensor t = tensors[ti];
    const U* x = reinterpret_cast<const U*>(t.data);
    const int64_t begin = (chunk - t.first_chunk) * kSqNormChunk;
    const int64_t end = min(t.numel, begin + kSqNormChunk);
    int bad = 0;
    int64_t rest = begin;
    if (t.data % 16 == 0) {
      const int64_t vectors = (end - begin) / kPerVector;
      const uint4* v = reinterpret_cast<const uint4*>(x + begin);
#pragma unroll 4
      for (int64_t k = threadIdx.x; k < vectors; k += blockDim.x) {
        const uint4 q = v[k];
        bad |= nonfinite_word<U>(q.x) | nonfinite_word<U>(q.y) | nonfinite_word<U>(q.z) | nonfinite_word<U>(q.w);
      }
      rest = begin + vectors * kPerVector;
    }
    for (int64_t i = rest + threadIdx.x; i < end; i += blockDim.x) bad |= nonfinite_bits(x[i]);
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      found[ti] = 1;
      *flag = 1;
    }
  }
}

}  // namespace grad_gpu
}  // namespace trainstream
