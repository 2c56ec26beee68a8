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

// nf4_code's thresholds in order, for the host's vector code search (quant_simd.cpp).
#define TS_NF4_THRESHOLD_BITS                                                                \
  {0xbf591cd9u, 0xbf1c5270u, 0xbeeb8480u, 0xbeadea76u, 0xbe703cecu, 0xbe0d38bcu, 0xbd3a7871u, \
   0x3d22faffu, 0x3df64863u, 0x3e5067e0u, 0x3e9582d4u, 0x3ec753f9u, 0x3f006d03u, 0x3f248dafu, \
   0x3f5c89d9u}

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
