// Element-level NF4 / int8 numerics shared by the CPU kernels (one build per SIMD level)
// and the CUDA kernels. Twin: ops/reference.py (quantization section).
//
// NF4 is bitsandbytes' format. A normalized value s = x * (1 / absmax) gets the number of
// decision thresholds below it (strict >): a value on a threshold takes the lower code,
// NaN takes code 0. The thresholds are the fp32 constants bitsandbytes' CUDA kernel
// compiles (four of them one ulp off the exact midpoints of the levels), written as bit
// patterns because parsing their decimal text through a double rounds those four the
// other way.
#pragma once

#include <cstdint>

#include "trainstream/numerics.h"

namespace trainstream {
namespace quant {

TS_HD static uint32_t nf4_code(float s) {
  using num::bits_to_float;
  uint32_t c = 0;
  c += s > bits_to_float(0xbf591cd9u);
  c += s > bits_to_float(0xbf1c5270u);
  c += s > bits_to_float(0xbeeb8480u);
  c += s > bits_to_float(0xbeadea76u);
  c += s > bits_to_float(0xbe703cecu);
  c += s > bits_to_float(0xbe0d38bcu);
  c += s > bits_to_float(0xbd3a7871u);
  c += s > bits_to_float(0x3d22faffu);
  c += s > bits_to_float(0x3df64863u);
  c += s > bits_to_float(0x3e5067e0u);
  c += s > bits_to_float(0x3e9582d4u);
  c += s > bits_to_float(0x3ec753f9u);
  c += s > bits_to_float(0x3f006d03u);
  c += s > bits_to_float(0x3f248dafu);
  c += s > bits_to_float(0x3f5c89d9u);
  return c;
}

// The same code as nf4_code, by halving: four comparisons, each picking the next threshold
// with selects (no nesting, no table lookup) so that a CPU loop over it vectorizes into
// compares and blends: about half the vector instructions of 15 compare-and-adds on AVX-512.
// For s > t a comparison with NaN is false, so NaN still gets code 0. The CPU loops use
// this; the CUDA kernels keep nf4_code.
TS_HD static uint32_t nf4_code_halving(float s) {
  using num::bits_to_float;
  const float t0 = bits_to_float(0xbf591cd9u), t1 = bits_to_float(0xbf1c5270u), t2 = bits_to_float(0xbeeb8480u),
              t3 = bits_to_float(0xbeadea76u), t4 = bits_to_float(0xbe703cecu), t5 = bits_to_float(0xbe0d38bcu),
              t6 = bits_to_float(0xbd3a7871u), t7 = bits_to_float(0x3d22faffu), t8 = bits_to_float(0x3df64863u),
              t9 = bits_to_float(0x3e5067e0u), t10 = bits_to_float(0x3e9582d4u), t11 = bits_to_float(0x3ec753f9u),
              t12 = bits_to_float(0x3f006d03u), t13 = bits_to_float(0x3f248dafu), t14 = bits_to_float(0x3f5c89d9u);
  const bool b3 = s > t7;  // upper half: codes 8-15
  const float q2 = b3 ? t11 : t3;
  const float q1a = b3 ? t9 : t1, q1b = b3 ? t13 : t5;
  const float q0a = b3 ? t8 : t0, q0b = b3 ? t10 : t2, q0c = b3 ? t12 : t4, q0d = b3 ? t14 : t6;
  const bool b2 = s > q2;
  const float r1 = b2 ? q1b : q1a;
  const float r0a = b2 ? q0c : q0a, r0b = b2 ? q0d : q0b;
  const bool b1 = s > r1;
  const bool b0 = s > (b1 ? r0b : r0a);
  return (b3 ? 8u : 0u) + (b2 ? 4u : 0u) + (b1 ? 2u : 0u) + (b0 ? 1u : 0u);
}

// The 16 NF4 levels (exact fp32 values of bitsandbytes' table).
#define TS_NF4_LEVELS                                                                       \
  {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,                \
   -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,              \
   0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, \
   0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f}

constexpr float kFltMin = 1.17549435e-38f;

// bitsandbytes' kernel runs with flush-to-zero: denormal fp32/bf16 inputs act as zero.
// Bit operations rather than a comparison, so the CPU loops stay vectorized.
TS_HD static float flush_denormal(float x) {
  uint32_t u = num::float_to_bits(x);
  return (u & 0x7f800000u) == 0 ? num::bits_to_float(u & 0x80000000u) : x;
}

// int8: q = rint(x * (127 / absmax)), half to even, clamped to [-127, 127]; NaN gives 0.
TS_HD static int8_t int8_code(float s) {
  float c = s > 127.0f ? 127.0f : (s < -127.0f ? -127.0f : s);
  c = s == s ? c : 0.0f;  // branch-free, so the CPU loop vectorizes
#ifdef __CUDA_ARCH__
  return static_cast<int8_t>(__float2int_rn(c));
#else
  return static_cast<int8_t>(static_cast<int32_t>(__builtin_rintf(c)));
#endif
}

}  // namespace quant
}  // namespace trainstream
