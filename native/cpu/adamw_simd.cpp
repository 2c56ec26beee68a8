// The AdamW element loop. CMake compiles this file three times, with -mavx512f..., with
// -mavx2 -mfma -mf16c, and with the baseline flags (see simd.h); adamw_cpu.cpp picks one
// build at run time.
//
// Why one source and auto-vectorization instead of intrinsics: with -ffp-contract=off
// (no FMA fusing) and IEEE sqrt and division, every ISA build computes the same bits,
// so results do not depend on the CPU, and the pure-torch twin in ops/reference.py,
// which performs the same fp32 operations one at a time, matches bit for bit. The loop
// is memory-bound (28 bytes per parameter with fp32 state), so the compiler's vector
// code reaches the bandwidth limit; -fopt-info-vec confirms the loops vectorize.
//
// Everything here has internal linkage (see adamw_kernel.h for why).
#include <cstdint>

#include "trainstream/adamw_kernel.h"
#include "trainstream/numerics.h"
#include "trainstream/simd.h"

#ifndef TS_ISA
#error "TS_ISA must name this build's SIMD level"
#endif

namespace trainstream {
namespace {

struct NoCopy {};
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

using num::bf16_rne;
using num::bf16_stochastic;
using num::f16_rne;
using num::mix32;

static inline float load(const float* p, uint32_t j) { return p[j]; }
static inline float load(const BF16* p, uint32_t j) { return num::bf16_to_float(p[j].bits); }

// `index` is the element's position in its tensor (low 32 bits): the counter the
// stochastic-rounding hash consumes.
template <typename M>
static inline void store_moments(M* m, M* v, uint32_t j, float mi, float vi, uint32_t key, uint32_t index);

template <>
inline void store_moments<float>(float* m, float* v, uint32_t j, float mi, float vi, uint32_t, uint32_t) {
  m[j] = mi;
  v[j] = vi;
}

template <>
inline void store_moments<BF16>(BF16* m, BF16* v, uint32_t j, float mi, float vi, uint32_t key,
                                uint32_t index) {
  // One hash per element: the low half rounds the first moment, the high half the second.
  uint32_t r = mix32(key ^ index);
  m[j].bits = bf16_stochastic(mi, r & 0xffffu);
  v[j].bits = bf16_stochastic(vi, r >> 16);
}

static inline void store_copy(NoCopy*, uint32_t, float) {}
static inline void store_copy(BF16* c, uint32_t j, float p) { c[j].bits = bf16_rne(p); }
static inline void store_copy(F16* c, uint32_t j, float p) { c[j].bits = f16_rne(p); }

// The order of operations mirrors torch.optim.AdamW's single-tensor path; each line is
// one fp32 operation of ops/reference.py. Pointers arrive offset to the range's start and
// the loop counts in 32 bits (a range is at most kAdamWChunk long): a 64-bit counter
// would make the compiler narrow a vector of 64-bit indices for the hash on every step.
template <typename G, typename M, typename C, bool kDecoupled>
void update_range(const AdamWScalars& s, float* __restrict p, const G* __restrict g,
                  M* __restrict m, M* __restrict v, C* __restrict copy, uint32_t n,
                  uint32_t index0, uint32_t key) {
  const float decay = s.decay, wd = s.weight_decay, omb1 = s.one_minus_beta1, b2 = s.beta2,
              omb2 = s.one_minus_beta2, bc2 = s.bias_correction2_sqrt, eps = s.eps,
              nss = s.neg_step_size, gs = s.grad_scale;
#pragma GCC ivdep
  for (uint32_t j = 0; j < n; ++j) {
    float gi = load(g, j) * gs;
    float pi = p[j];
    if (kDecoupled) {
      pi = pi * decay;
    } else {
      gi = gi + wd * pi;
    }
    float mi = load(m, j);
    float vi = load(v, j);
    mi = mi + omb1 * (gi - mi);
    vi = vi * b2 + omb2 * (gi * gi);
    float denom = __builtin_sqrtf(vi) / bc2 + eps;
    pi = pi + nss * (mi / denom);
    p[j] = pi;
    store_moments(m, v, j, mi, vi, key, index0 + j);
    store_copy(copy, j, pi);
  }
}

template <typename G, typename M, typename C>
void dispatch_decoupled(const AdamWConfig& cfg, const AdamWScalars& s, const AdamWTensor& t,
                        int64_t begin, int64_t end, uint32_t key) {
  auto* p = t.param + begin;
  auto* g = static_cast<const G*>(t.grad) + begin;
  auto* m = static_cast<M*>(t.exp_avg) + begin;
  auto* v = static_cast<M*>(t.exp_avg_sq) + begin;
  auto* c = static_cast<C*>(t.param_copy) + (t.param_copy ? begin : 0);
  const auto n = static_cast<uint32_t>(end - begin);
  const auto index0 = static_cast<uint32_t>(begin);
  if (cfg.decoupled)
    update_range<G, M, C, true>(s, p, g, m, v, c, n, index0, key);
  else
    update_range<G, M, C, false>(s, p, g, m, v, c, n, index0, key);
}

template <typename G, typename M>
void dispatch_copy(const AdamWConfig& cfg, const AdamWScalars& s, const AdamWTensor& t,
                   int64_t begin, int64_t end, uint32_t key) {
  switch (cfg.copy_dtype) {
    case DType::kBFloat16: return dispatch_decoupled<G, M, BF16>(cfg, s, t, begin, end, key);
    case DType::kFloat16: return dispatch_decoupled<G, M, F16>(cfg, s, t, begin, end, key);
    default: return dispatch_decoupled<G, M, NoCopy>(cfg, s, t, begin, end, key);
  }
}

template <typename G>
void dispatch_moments(const AdamWConfig& cfg, const AdamWScalars& s, const AdamWTensor& t,
                      int64_t begin, int64_t end, uint32_t key) {
  if (cfg.moment_dtype == DType::kBFloat16)
    dispatch_copy<G, BF16>(cfg, s, t, begin, end, key);
  else
    dispatch_copy<G, float>(cfg, s, t, begin, end, key);
}

}  // namespace

void TS_ISA_FN(adamw_range)(const AdamWConfig& cfg, const AdamWScalars& s, const AdamWTensor& t, int64_t begin,
               int64_t end) {
  // Element indices beyond 2^32 fold their high half into the key, so the stream of
  // random bits never repeats within a tensor.
  uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(begin) >> 32);
  uint32_t key = hi ? mix32(s.rng_key ^ hi) : s.rng_key;
  if (cfg.grad_dtype == DType::kBFloat16)
    dispatch_moments<BF16>(cfg, s, t, begin, end, key);
  else
    dispatch_moments<float>(cfg, s, t, begin, end, key);
}

}  // namespace trainstream
