// The fused cross-entropy row kernel (trainstream/loss_gpu.h). One block per row and two
// passes over it: the first reads the row once for its max and its sum of exponentials
// (each thread keeps a running max and the sum of exp(x - that max), rescaled when the max
// grows; the threads' pairs are then merged in a fixed order, so a row gives the same bits
// on every run), the second reads each element again and writes its gradient over it. No
// temporary: 2 reads and 1 write of the row in its own dtype, where the pure-torch twin
// passes over an fp32 copy several times. 16-byte loads and stores over the part of the row
// that is 16-byte aligned; the elements before it and after the last whole vector one by one.
#pragma once

#include <cmath>
#include <cstdint>

#include "trainstream/loss_gpu.h"
#include "trainstream/numerics.h"

namespace trainstream {
namespace loss_gpu {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

struct BF16 { uint16_t bits; };
struct Half { uint16_t bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(BF16 x) { return num::bf16_to_float(x.bits); }
__device__ __forceinline__ float to_float(Half x) { return num::f16_to_float(x.bits); }

// Round to nearest even, as torch rounds an fp32 result stored to a 16-bit tensor.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ BF16 from_float<BF16>(float x) { return BF16{num::bf16_rne(x)}; }
template <> __device__ __forceinline__ Half from_float<Half>(float x) { return Half{num::f16_rne(x)}; }

// The elements of one 16-byte vector as fp32, and back (little-endian: the element at the
// lower address is the low half of its 32-bit word).
template <typename T> struct Lanes {  // 16-bit elements
  static constexpr int kN = 8;
  __device__ static __forceinline__ void unpack(const uint4& q, float (&x)[kN]) {
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < kN; ++k) x[k] = to_float(T{static_cast<uint16_t>(w[k >> 1] >> (16 * (k & 1)))});
  }
  __device__ static __forceinline__ uint4 pack(const float (&x)[kN]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      w[k] = uint32_t(from_float<T>(x[2 * k]).bits) | (uint32_t(from_float<T>(x[2 * k + 1]).bits) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};
template <> struct Lanes<float> {
  static constexpr int kN = 4;
  __device__ static __forceinline__ void unpack(const uint4& q, float (&x)[kN]) {
    x[0] = __uint_as_float(q.x);
    x[1] = __uint_as_float(q.y);
    x[2] = __uint_as_float(q.z);
    x[3] = __uint_as_float(q.w);
  }
  __device__ static __forceinline__ uint4 pack(const float (&x)[kN]) {
    return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  }
};

// A running share of a row: its largest value m (never NaN) and s = the sum of exp(x - m)
// over its values (at most their count: every term is <= 1).
struct MaxSum {
  float m;
  float s;
};

// Adds n values to a running pair; `nan` records a NaN among them (fmaxf passes over NaN).
// A value of -inf adds exp(-inf - m) = 0 once the max is finite, and nothing while the
// running max is -inf too (exp(-inf - -inf) would be NaN). A row whose max is not finite is
// made NaN at the end, as the twin's formula makes it, so what s holds then does not matter.
template <int N>
__device__ __forceinline__ void add_values(MaxSum& a, const float (&x)[N], bool& nan) {
  float vmax = x[0];
#pragma unroll
  for (int i = 1; i < N; ++i) vmax = fmaxf(vmax, x[i]);
#pragma unroll
  for (int i = 0; i < N; ++i) nan |= x[i] != x[i];
  if (vmax > a.m) {
    a.s *= expf(a.m - vmax);  // exp(-inf) = 0 for the first finite max
    a.m = vmax;
  }
  if (a.m == -INFINITY) return;
#pragma unroll
  for (int i = 0; i < N; ++i) a.s += expf(x[i] - a.m);
}

// Commutative (fmaxf and the fp32 addition are), so both lanes of a butterfly step get the
// same bits. (-inf, 0) is its identity.
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return MaxSum{m, 0.0f};
  return MaxSum{m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = merge(v, MaxSum{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}

// The row's pair from every thread's, the same in every thread; row_nan: whether any thread
// saw a NaN. Ends with a barrier.
__device__ __forceinline__ MaxSum block_merge(MaxSum v, bool nan, bool& row_nan) {
  __shared__ float warp_m[kWarps], warp_s[kWarps];
  __shared__ float row_m, row_s;
  v = warp_merge(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    warp_m[warp] = v.m;
    warp_s[warp] = v.s;
  }
  row_nan = __syncthreads_or(nan) != 0;  // also the barrier before warp 0 reads the warps' pairs
  if (warp == 0) {
    v = warp_merge(lane < kWarps ? MaxSum{warp_m[lane], warp_s[lane]} : MaxSum{-INFINITY, 0.0f});
    if (lane == 0) {
      row_m = v.m;
      row_s = v.s;
    }
  }
  __syncthreads();
  return MaxSum{row_m, row_s};
}

__device__ __forceinline__ float dlogit(float x, int64_t j, float m, float s, float q, int64_t target) {
  float e = expf(x - m);
  if (j == target) e -= s;  // the twin's scatter_add of -s at the target: e_t - s
  return e * q;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) cross_entropy_rows(CrossEntropyRows a) {
  using L = Lanes<T>;
  constexpr int kN = L::kN;
  const int64_t r = blockIdx.x;
  const int64_t vocab = a.vocab;
  T* row = static_cast<T*>(a.logits) + r * a.row_stride;
  const int64_t c = a.column[r];
  const bool in_range = c >= 0 && c < vocab;
  // The target's logit, read before the second pass writes over it.
  const float picked = threadIdx.x == 0 && in_range ? to_float(row[c]) : 0.0f;

  // Elements [0, head) before the first 16-byte boundary (a torch tensor's elements are
  // aligned to their size), whole vectors, then [tail, vocab).
  const uintptr_t address = reinterpret_cast<uintptr_t>(row);
  const int64_t head = min(vocab, static_cast<int64_t>((16 - address % 16) % 16 / sizeof(T)));
  const int64_t vectors = (vocab - head) / kN;
  const int64_t tail = head + vectors * kN;
  uint4* body = reinterpret_cast<uint4*>(row + head);

  MaxSum acc{-INFINITY, 0.0f};
  bool nan = false;
  for (int64_t j = threadIdx.x; j < head; j += kThreads) {
    const float x[1] = {to_float(row[j])};
    add_values(acc, x, nan);
  }
#pragma unroll 2
  for (int64_t k = threadIdx.x; k < vectors; k += kThreads) {
    float x[kN];
    L::unpack(body[k], x);
    add_values(acc, x, nan);
  }
  for (int64_t j = tail + threadIdx.x; j < vocab; j += kThreads) {
    const float x[1] = {to_float(row[j])};
    add_values(acc, x, nan);
  }
  bool row_nan;
  const MaxSum total = block_merge(acc, nan, row_nan);
  const float m = total.m;
  // The twin gives NaN for a row holding a NaN or whose max is +-inf (z - m is NaN at the
  // max); so does this, and for a target column outside the row.
  const float s = row_nan || !isfinite(m) || !in_range ? __int_as_float(0x7fc00000) : total.s;
  if (threadIdx.x == 0) a.loss[r] = logf(s) - (picked - m);  // log_softmax's order
  if (!a.write_dlogits) return;

  const float q = a.scale[r] / s;
  const int64_t target = a.valid[r] ? c : -1;
  for (int64_t j = threadIdx.x; j < head; j += kThreads)
    row[j] = from_float<T>(dlogit(to_float(row[j]), j, m, s, q, target));
#pragma unroll 2
  for (int64_t k = threadIdx.x; k < vectors; k += kThreads) {
    float x[kN];
    L::unpack(body[k], x);
    const int64_t j0 = head + k * kN;
#pragma unroll
    for (int i = 0; i < kN; ++i) x[i] = dlogit(x[i], j0 + i, m, s, q, target);
    body[k] = L::pack(x);
  }
  for (int64_t j = tail + threadIdx.x; j < vocab; j += kThreads)
    row[j] = from_float<T>(dlogit(to_float(row[j]), j, m, s, q, target));
}

}  // namespace loss_gpu
}  // namespace trainstream
