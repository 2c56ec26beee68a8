// Element-level numerics shared by the CPU kernels (compiled once per SIMD level) and the
// CUDA kernels, so both produce the same bits by construction.
//
// Everything here is `static inline` (internal linkage): the SIMD kernel files include it
// under -mavx2 / -mavx512f, and an inline function with external linkage could be merged
// by the linker into code that runs on CPUs without those instructions.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline
#endif

namespace trainstream {
namespace num {

TS_HD static float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

TS_HD static uint32_t float_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}

TS_HD static float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// fp32 -> bf16, round to nearest even; NaN becomes a quiet NaN (0x7fc0 with its sign;
// NaN payloads are the one thing not kept bit-identical anywhere in this project).
TS_HD static uint16_t bf16_rne(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// fp32 -> bf16, rounding up with probability equal to the dropped fraction: adding 16
// uniform random bits below the kept ones and truncating is unbiased in expectation.
// Magnitudes round away from zero symmetrically because bf16 is sign-magnitude.
TS_HD static uint16_t bf16_stochastic(float f, uint32_t random16) {
  uint32_t u = float_to_bits(f);
  uint32_t rounded = (u + random16) >> 16;
  uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// fp32 -> fp16, round to nearest even, branch-free so it vectorizes (after F. Giesen's
// float_to_half_fast3_rtne). Matches torch's conversion, NaN included (0x7e00 | sign).
TS_HD static uint16_t f16_rne(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = u & 0x80000000u;
  uint32_t a = u ^ sign;
  // |f| >= 65536 (or inf/NaN): all exponent bits set.
  uint32_t inf_nan = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // Subnormal or zero result: an fp32 add aligns the mantissa, rounding to nearest even.
  const uint32_t denorm_magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t sub = float_to_bits(bits_to_float(a) + bits_to_float(denorm_magic_bits)) - denorm_magic_bits;
  // Normal result: rebias the exponent and round to nearest even by hand.
  uint32_t mant_odd = (a >> 13) & 1u;
  uint32_t normal = (a + (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd) >> 13;
  uint32_t out = a >= (143u << 23) ? inf_nan : (a < (113u << 23) ? sub : normal);
  return uint16_t(out | (sign >> 16));
}

// fp16 -> fp32, exact and branch-free (after F. Giesen's half_to_float): subnormals are
// renormalized by subtracting a power of two, so no fp32 subnormal is ever formed.
TS_HD static float f16_to_float(uint16_t h) {
  uint32_t o = uint32_t(h & 0x7fffu) << 13;  // exponent and mantissa in fp32 position
  uint32_t exp = o & 0x0f800000u;
  float normal = bits_to_float(o + (112u << 23));
  float special = bits_to_float(o + (224u << 23));  // inf/NaN: exponent all ones
  float sub = bits_to_float(o + (113u << 23)) - bits_to_float(113u << 23);
  float mag = exp == 0x0f800000u ? special : (exp == 0 ? sub : normal);
  return bits_to_float(float_to_bits(mag) | (uint32_t(h & 0x8000u) << 16));
}

// Counter-based hash (Wellons' "lowbias32"): a bijection on 32 bits with good avalanche,
// cheap enough to vectorize. Its pure-torch twin is ops/reference.py's mix32.
TS_HD static uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

}  // namespace num
}  // namespace trainstream
