// The zero-copy AdamW kernel. Each thread block updates one chunk of one tensor; threads
// move 4 elements at a time so every warp reads and writes 16-byte-per-thread runs of host
// memory (full PCIe transactions). The arithmetic is native/cpu/adamw_simd.cpp's, one
// rounded operation at a time (__f*_rn never fuse into FMAs), so results equal the host
// AdamW's bit for bit.
#pragma once

#include <cstdint>

#include "trainstream/adamw_gpu.h"
#include "trainstream/numerics.h"

namespace trainstream {
namespace adamw_gpu {

struct Scalars {
  float decay, weight_decay, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      neg_step_size, grad_scale;
};

__device__ __forceinline__ float load_elem(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_elem(const uint16_t* p, int64_t i) { return num::bf16_to_float(p[i]); }

__device__ __forceinline__ void load4(const float* p, int64_t i, float (&out)[4]) {
  float4 v = *reinterpret_cast<const float4*>(p + i);
  out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, int64_t i, float (&out)[4]) {
  uint2 v = *reinterpret_cast<const uint2*>(p + i);
  out[0] = num::bits_to_float(v.x << 16); out[1] = num::bits_to_float(v.x & 0xffff0000u);
  out[2] = num::bits_to_float(v.y << 16); out[3] = num::bits_to_float(v.y & 0xffff0000u);
}
__device__ __forceinline__ void store4(float* p, int64_t i, const float (&x)[4]) {
  *reinterpret_cast<float4*>(p + i) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store4_bits(uint16_t* p, int64_t i, const uint16_t (&b)[4]) {
  *reinterpret_cast<uint2*>(p + i) =
      make_uint2(uint32_t(b[0]) | (uint32_t(b[1]) << 16), uint32_t(b[2]) | (uint32_t(b[3]) << 16));
}

// One element's update; returns the new weight and writes the new moments to mi, vi.
template <bool kDecoupled>
__device__ __forceinline__ float update(const Scalars& s, float gs, float g, float p, float& mi, float& vi) {
  g = __fmul_rn(g, gs);
  if (kDecoupled) {
    p = __fmul_rn(p, s.decay);
  } else {
    g = __fadd_rn(g, __fmul_rn(s.weight_decay, p));
  }
  mi = __fadd_rn(mi, __fmul_rn(s.one_minus_beta1, __fsub_rn(g, mi)));
  vi = __fadd_rn(__fmul_rn(vi, s.beta2), __fmul_rn(s.one_minus_beta2, __fmul_rn(g, g)));
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bias_correction2_sqrt), s.eps);
  return __fadd_rn(p, __fmul_rn(s.neg_step_size, __fdiv_rn(mi, denom)));
}

__device__ __forceinline__ int find_tensor(const GpuAdamWTensor* t, int n, int64_t chunk) {
  int lo = 0, hi = n - 1;  // last tensor whose first_chunk <= chunk
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (t[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename M, bool kDecoupled>
__device__ __forceinline__ void update_one(const Scalars& s, float gs, float g, float* master, M* m, M* v,
                                           int64_t j, uint32_t key, bool copy_out, DType pd, int64_t param) {
  float mi = load_elem(m, j), vi = load_elem(v, j);
  float p = update<kDecoupled>(s, gs, g, master[j], mi, vi);
  master[j] = p;
  if constexpr (sizeof(M) == 4) {
    m[j] = mi;
    v[j] = vi;
  } else {
    uint32_t r = num::mix32(key ^ uint32_t(j));
    m[j] = num::bf16_stochastic(mi, r & 0xffffu);
    v[j] = num::bf16_stochastic(vi, r >> 16);
  }
  if (copy_out) {
    if (pd == DType::kFloat32) reinterpret_cast<float*>(param)[j] = p;
    else if (pd == DType::kBFloat16) reinterpret_cast<uint16_t*>(param)[j] = num::bf16_rne(p);
    else reinterpret_cast<uint16_t*>(param)[j] = num::f16_rne(p);
  }
}

// Four elements from `i` on, their values loaded: update, then store master, moments and copy.
template <typename M, bool kDecoupled>
__device__ __forceinline__ void update4(const Scalars& s, float gs, int64_t i, const float (&gv)[4], float (&pv)[4],
                                        float (&mv)[4], float (&vv)[4], float* master, M* m, M* v, uint32_t key,
                                        bool copy_out, DType pd, int64_t param) {
#pragma unroll
  for (int k = 0; k < 4; ++k) pv[k] = update<kDecoupled>(s, gs, gv[k], pv[k], mv[k], vv[k]);
  store4(master, i, pv);
  if constexpr (sizeof(M) == 4) {
    store4(reinterpret_cast<float*>(m), i, mv);
    store4(reinterpret_cast<float*>(v), i, vv);
  } else {
    uint16_t mb[4], vb[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t r = num::mix32(key ^ uint32_t(i + k));
      mb[k] = num::bf16_stochastic(mv[k], r & 0xffffu);
      vb[k] = num::bf16_stochastic(vv[k], r >> 16);
    }
    store4_bits(m, i, mb);
    store4_bits(v, i, vb);
  }
  if (copy_out) {
    if (pd == DType::kFloat32) {
      store4(reinterpret_cast<float*>(param), i, pv);
    } else {
      uint16_t cb[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) cb[k] = pd == DType::kBFloat16 ? num::bf16_rne(pv[k]) : num::f16_rne(pv[k]);
      store4_bits(reinterpret_cast<uint16_t*>(param), i, cb);
    }
  }
}

// G: gradient element type, M: moment element type (float, or uint16_t holding bf16 bits).
template <typename G, typename M, bool kDecoupled>
__device__ void update_chunk(const GpuAdamWLaunch& L, int64_t chunk) {
  const int ti = find_tensor(L.tensors, L.num_tensors, chunk);
  if (L.tensor_skip != nullptr && L.tensor_skip[ti] != 0) return;  // every chunk of a skipped tensor returns here
  const GpuAdamWTensor t = L.tensors[ti];
  const float* sp = L.scalars + int64_t(ti) * kGpuScalarFields;
  const Scalars s{sp[0], sp[1], sp[2], sp[3], sp[4], sp[5], sp[6], sp[7], sp[8]};
  const float gs = L.grad_scale ? __fmul_rn(s.grad_scale, *L.grad_scale) : s.grad_scale;

  const int64_t begin = (chunk - t.first_chunk) * kGpuAdamWChunk;
  const int64_t end = min(t.numel, begin + kGpuAdamWChunk);
  // Indices past 2^32 fold their high half into the key, as on the host.
  const uint32_t hi = uint32_t(uint64_t(begin) >> 32);
  const uint32_t key = hi ? num::mix32(uint32_t(t.rng_key) ^ hi) : uint32_t(t.rng_key);

  const G* g = reinterpret_cast<const G*>(t.grad);
  M* m = reinterpret_cast<M*>(t.exp_avg);
  M* v = reinterpret_cast<M*>(t.exp_avg_sq);
  // The master weights: host fp32, or the fp32 GPU param itself (then nothing to copy).
  float* master = reinterpret_cast<float*>(t.master ? t.master : t.param);
  const bool copy_out = t.master != 0;
  const DType pd = L.param_dtype;
  const int64_t param_bytes = pd == DType::kFloat32 ? 4 : 2;

  // The vector path needs every pointer aligned to 4 elements; chunk starts keep that.
  const bool aligned = reinterpret_cast<uintptr_t>(master) % 16 == 0 && t.grad % (4 * int64_t(sizeof(G))) == 0 &&
                       t.exp_avg % (4 * int64_t(sizeof(M))) == 0 && t.exp_avg_sq % (4 * int64_t(sizeof(M))) == 0 &&
                       (!copy_out || t.param % (4 * param_bytes) == 0);
  if (!aligned) {
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x)
      update_one<M, kDecoupled>(s, gs, load_elem(g, j), master, m, v, j, key, copy_out, pd, t.param);
    return;
  }
  // fp32 moments: four vector slots per thread per pass, every load issued before any
  // update. The moments come over PCIe (about a microsecond away), and a capped grid needs
  // many loads in flight per thread to fill it. bf16 moments keep one slot per pass: with
  // four, the full grid's rate halved in the optimizer_gpu suite (cause not pinned down).
  // Then single slots up to the chunk's end.
  constexpr int kSlots = sizeof(M) == 4 ? 4 : 1;
  const int64_t stride = int64_t(blockDim.x) * 4;
  int64_t i = begin + int64_t(threadIdx.x) * 4;
  for (; i + (kSlots - 1) * stride + 3 < end; i += kSlots * stride) {
    float gv[kSlots][4], pv[kSlots][4], mv[kSlots][4], vv[kSlots][4];
#pragma unroll
    for (int u = 0; u < kSlots; ++u) {
      load4(g, i + u * stride, gv[u]);
      load4(master, i + u * stride, pv[u]);
      load4(m, i + u * stride, mv[u]);
      load4(v, i + u * stride, vv[u]);
    }
#pragma unroll
    for (int u = 0; u < kSlots; ++u)
      update4<M, kDecoupled>(s, gs, i + u * stride, gv[u], pv[u], mv[u], vv[u], master, m, v, key, copy_out, pd,
                             t.param);
  }
  for (; i + 3 < end; i += stride) {
    float gv[4], pv[4], mv[4], vv[4];
    load4(g, i, gv);
    load4(master, i, pv);
    load4(m, i, mv);
    load4(v, i, vv);
    update4<M, kDecoupled>(s, gs, i, gv, pv, mv, vv, master, m, v, key, copy_out, pd, t.param);
  }
  // The slot that straddles the end of the chunk (1 to 3 elements) belongs to one thread.
  for (int64_t j = i; j < end; ++j)
    update_one<M, kDecoupled>(s, gs, load_elem(g, j), master, m, v, j, key, copy_out, pd, t.param);
}

// One block per chunk, or (max_blocks) fewer blocks that loop over the chunks.
template <typename G, typename M, bool kDecoupled>
__global__ void __launch_bounds__(256) adamw_kernel(GpuAdamWLaunch L) {
  if (L.skip_flag != nullptr && *L.skip_flag != 0) return;  // a non-finite gradient: nothing is written
  for (int64_t chunk = blockIdx.x; chunk < L.num_chunks; chunk += gridDim.x) update_chunk<G, M, kDecoupled>(L, chunk);
}

}  // namespace adamw_gpu
}  // namespace trainstream
