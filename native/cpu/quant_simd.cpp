// NF4 and int8 element loops, compiled once per SIMD level (see simd.h). The numerics are
// quant_numerics.h's, shared with the CUDA kernels.
#include <cstdint>
#include <type_traits>
#include <vector>

#include "trainstream/dtype.h"
#include "trainstream/numerics.h"
#include "trainstream/quant.h"
#include "trainstream/quant_numerics.h"
#include "trainstream/simd.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the NF4 packing loop reads code pairs little-endian");

namespace trainstream {
namespace {

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const BF16* p, int64_t i) { return num::bf16_to_float(p[i].bits); }
inline float load(const F16* p, int64_t i) { return num::f16_to_float(p[i].bits); }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(BF16* p, int64_t i, float v) { p[i].bits = num::bf16_rne(v); }
inline void store(F16* p, int64_t i, float v) { p[i].bits = num::f16_rne(v); }

// NF4 inputs follow bitsandbytes' flush-to-zero; fp16 has no fp32 denormals to flush.
template <typename T, bool kFlush>
inline float load_q(const T* p, int64_t i) {
  float v = load(p, i);
  return kFlush ? quant::flush_denormal(v) : v;
}

// Max |x| over [start, end), ignoring NaN (a comparison with NaN keeps the running max, as
// fmaxf does), from `init`. Sixteen running maxima keep the loop vectorizable.
template <typename T, bool kFlush>
float block_absmax(const T* x, int64_t start, int64_t end, float init) {
  float acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = init;
  int64_t i = start;
  for (; i + 16 <= end; i += 16) {
    for (int k = 0; k < 16; ++k) {
      const float v = __builtin_fabsf(load_q<T, kFlush>(x, i + k));
      acc[k] = v > acc[k] ? v : acc[k];
    }
  }
  for (; i < end; ++i) {
    const float v = __builtin_fabsf(load_q<T, kFlush>(x, i));
    acc[0] = v > acc[0] ? v : acc[0];
  }
  // Tree reduction: each halving step is one vector max.
  for (int w = 8; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) acc[k] = acc[k + w] > acc[k] ? acc[k + w] : acc[k];
  return acc[0];
}

// Max |v[i]| over a fixed-size block (K a multiple of 16), from `init`; a NaN keeps the
// running max, as fmaxf does. Written with vector types one register wide: left to the
// vectorizer, the same loop over eight scalar maxima stayed scalar (vmaxss) and was the
// quantize's costliest part (a type wider than the register spilled to the stack instead).
// The order of a max reduction cannot change its result: fabs makes both zeros +0, and NaN
// never enters the running max.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float LaneF32 __attribute__((vector_size(4 * kLanes)));
typedef uint32_t LaneU32 __attribute__((vector_size(4 * kLanes)));
typedef int32_t LaneMask __attribute__((vector_size(4 * kLanes)));  // a comparison's result: -1 or 0

template <int K>
inline float absmax_fixed(const float* v, float init) {
  static_assert(K % 16 == 0, "absmax_fixed reads whole vectors");
  LaneF32 acc;
  for (int k = 0; k < kLanes; ++k) acc[k] = init;
  for (int i = 0; i < K; i += kLanes) {
    LaneU32 bits;
    __builtin_memcpy(&bits, v + i, sizeof(bits));
    bits &= 0x7fffffffu;  // |v|
    LaneF32 m;
    __builtin_memcpy(&m, &bits, sizeof(m));
    acc = m > acc ? m : acc;
  }
  float lanes[kLanes];  // stored whole, then read by lane: a tree of independent maxima
  __builtin_memcpy(lanes, &acc, sizeof(lanes));
  for (int w = kLanes / 2; w > 0; w >>= 1)
    for (int k = 0; k < w; ++k) lanes[k] = lanes[k + w] > lanes[k] ? lanes[k + w] : lanes[k];
  return lanes[0];
}

// quant::nf4_code of one register of values, by halving: four comparisons, each picking
// the next threshold with a blend: about half the instructions of 15 compare-and-adds.
// Vector types, not a scalar loop left to the vectorizer: GCC 13 compiled the scalar form
// of these selects into branches, ten times slower on random weights than GCC 12's blends.
// For s > t a comparison with NaN is false, so NaN gets code 0, as in nf4_code.
inline LaneU32 nf4_codes_lanes(LaneF32 s) {
  static constexpr uint32_t kBits[15] = TS_NF4_THRESHOLD_BITS;
  LaneF32 t[15];
  for (int i = 0; i < 15; ++i) t[i] = LaneF32{} + num::bits_to_float(kBits[i]);
  const LaneMask b3 = s > t[7];  // upper half: codes 8-15
  const LaneF32 q2 = b3 ? t[11] : t[3];
  const LaneF32 q1a = b3 ? t[9] : t[1], q1b = b3 ? t[13] : t[5];
  const LaneF32 q0a = b3 ? t[8] : t[0], q0b = b3 ? t[10] : t[2], q0c = b3 ? t[12] : t[4], q0d = b3 ? t[14] : t[6];
  const LaneMask b2 = s > q2;
  const LaneF32 r1 = b2 ? q1b : q1a;
  const LaneF32 r0a = b2 ? q0c : q0a, r0b = b2 ? q0d : q0b;
  const LaneMask b1 = s > r1;
  const LaneMask b0 = s > (b1 ? r0b : r0a);
  return (LaneU32)((b3 & 8) | (b2 & 4) | (b1 & 2) | (b0 & 1));
}

// A full block of a common size (K): converted to fp32 once into a local array, then its
// absmax and its codes are taken from that (one conversion of the input, not two). With the
// trip counts known at compile time the loops have no prologue or epilogue.
template <typename T, bool kFlush, int K>
inline float code_block_fixed(const T* x, uint32_t* codes) {
  float v[K];
  for (int i = 0; i < K; ++i) v[i] = load_q<T, kFlush>(x, i);
  // bitsandbytes reduces from -FLT_MAX, so an all-NaN block keeps that value.
  const float m = absmax_fixed<K>(v, -3.40282347e38f);
  const float r = 1.0f / m;  // +inf for an all-zero block: 0 * inf = NaN -> code 0
  for (int i = 0; i < K; i += kLanes) {
    LaneF32 s;
    __builtin_memcpy(&s, v + i, sizeof(s));
    const LaneU32 c = nf4_codes_lanes(s * r);
    __builtin_memcpy(codes + i, &c, sizeof(c));
  }
  return m;
}

// Blocks are coded into an L1-resident scratch of 32-bit codes piece by piece (a narrower
// scratch makes the compiler narrow every comparison's result to bytes before adding: a
// pack per threshold), then pairs of codes are packed into bytes. K is the block size
// when it is one of the common fixed sizes, else 0.
constexpr int64_t kPiece = 4096;

template <typename T, int K>
void nf4_quantize(const QuantArgs& a, int64_t b0, int64_t b1) {
  constexpr bool kFlush = !std::is_same<T, F16>::value;
  const T* x = static_cast<const T*>(a.values);
  uint8_t* packed = static_cast<uint8_t*>(a.codes);
  const int64_t bs = a.block_size;
  const int64_t blocks_per_piece = kPiece / bs > 0 ? kPiece / bs : 1;
  uint32_t codes[(kPiece > 2 ? kPiece : 2) + 2];
  std::vector<uint32_t> big;  // only for blocks larger than a piece
  uint32_t* scratch = codes;
  if (bs > kPiece) {
    big.resize(static_cast<size_t>(bs) + 2);
    scratch = big.data();
  }
  for (int64_t pb = b0; pb < b1; pb += blocks_per_piece) {
    const int64_t pb_end = pb + blocks_per_piece < b1 ? pb + blocks_per_piece : b1;
    const int64_t p0 = pb * bs;
    float r = 0.0f;
    int64_t len = 0;
    for (int64_t b = pb; b < pb_end; ++b) {
      const int64_t start = b * bs;
      const int64_t end = start + bs < a.numel ? start + bs : a.numel;
      const bool full = K != 0 && end - start == K;
      if (full) {
        a.absmax[b] = code_block_fixed<T, kFlush, (K ? K : 16)>(x + start, scratch + (start - p0));
        r = 1.0f / a.absmax[b];
      } else {
        // bitsandbytes reduces from -FLT_MAX, so an all-NaN block keeps that value.
        const float m = block_absmax<T, kFlush>(x, start, end, -3.40282347e38f);
        a.absmax[b] = m;
        r = 1.0f / m;  // +inf for an all-zero block: 0 * inf = NaN -> code 0
        for (int64_t i = start; i < end; ++i) scratch[i - p0] = quant::nf4_code(load_q<T, kFlush>(x, i) * r);
      }
      len = end - p0;
    }
    if (len & 1) scratch[len++] = quant::nf4_code(0.0f * r);  // odd length: a zero pads the last byte
    uint8_t* dst = packed + p0 / 2;
    for (int64_t j = 0; j < len / 2; ++j) {
      // One 64-bit load per pair (little-endian: the even element's code is the low half);
      // the compiler vectorizes this where it left two 32-bit loads per byte scalar.
      uint64_t pair;
      __builtin_memcpy(&pair, scratch + 2 * j, 8);
      dst[j] = static_cast<uint8_t>((pair << 4) | (pair >> 32));
    }
  }
}

template <typename T>
void nf4_dequantize(const QuantArgs& a, int64_t e0, int64_t e1) {
  static const float kLevels[16] = TS_NF4_LEVELS;
  T* out = static_cast<T*>(a.values);
  const uint8_t* packed = static_cast<const uint8_t*>(a.codes);
  for (int64_t start = e0; start < e1; start += a.block_size) {
    const int64_t end = start + a.block_size < e1 ? start + a.block_size : e1;
    const float scale = a.absmax[start / a.block_size];
    const int64_t pair_end = end / 2;
    for (int64_t j = start / 2; j < pair_end; ++j) {
      const uint32_t byte = packed[j];
      // bitsandbytes' kernel flushes a denormal product to zero.
      store(out, 2 * j, quant::flush_denormal(kLevels[byte >> 4] * scale));
      store(out, 2 * j + 1, quant::flush_denormal(kLevels[byte & 15u] * scale));
    }
    if (end & 1) store(out, end - 1, quant::flush_denormal(kLevels[packed[pair_end] >> 4] * scale));
  }
}

// int8's counterpart of code_block_fixed.
template <typename T, int K>
inline float int8_block_fixed(const T* x, int8_t* q) {
  float v[K];
  for (int i = 0; i < K; ++i) v[i] = load(x, i);
  const float m = absmax_fixed<K>(v, 0.0f);  // NaN ignored; an all-NaN block gives 0
  const float r = 127.0f / m;
  for (int i = 0; i < K; ++i) q[i] = quant::int8_code(v[i] * r);
  return m;
}

template <typename T, int K>
void int8_quantize(const QuantArgs& a, int64_t b0, int64_t b1) {
  const T* x = static_cast<const T*>(a.values);
  int8_t* q = static_cast<int8_t*>(a.codes);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t end = start + a.block_size < a.numel ? start + a.block_size : a.numel;
    if (K != 0 && end - start == K) {
      a.absmax[b] = int8_block_fixed<T, (K ? K : 16)>(x + start, q + start);  // 16: unused when K == 0
      continue;
    }
    const float amax = block_absmax<T, false>(x, start, end, 0.0f);
    a.absmax[b] = amax;
    const float r = 127.0f / amax;
    for (int64_t i = start; i < end; ++i) q[i] = quant::int8_code(load(x, i) * r);
  }
}

template <typename T>
void int8_dequantize(const QuantArgs& a, int64_t e0, int64_t e1) {
  T* out = static_cast<T*>(a.values);
  const int8_t* q = static_cast<const int8_t*>(a.codes);
  for (int64_t start = e0; start < e1; start += a.block_size) {
    const int64_t end = start + a.block_size < e1 ? start + a.block_size : e1;
    const float scale = a.absmax[start / a.block_size] / 127.0f;
    for (int64_t i = start; i < end; ++i) store(out, i, static_cast<float>(q[i]) * scale);
  }
}

// Calls f(std::integral_constant<int, K>) with K the block size when it is one of the
// common sizes the fixed-size block loops are built for, else K = 0.
template <typename F>
void with_fixed_block_size(int64_t block_size, F&& f) {
  switch (block_size) {
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

template <typename T>
void nf4_quantize_bs(const QuantArgs& a, int64_t b0, int64_t b1) {
  with_fixed_block_size(a.block_size, [&](auto k) { nf4_quantize<T, decltype(k)::value>(a, b0, b1); });
}

template <typename T>
void int8_quantize_bs(const QuantArgs& a, int64_t b0, int64_t b1) {
  with_fixed_block_size(a.block_size, [&](auto k) { int8_quantize<T, decltype(k)::value>(a, b0, b1); });
}

}  // namespace

void TS_ISA_FN(quantize_blocks)(const QuantArgs& a, int64_t b0, int64_t b1) {
  const bool nf4 = a.format == QuantFormat::kNF4;
  switch (a.dtype) {
    case DType::kBFloat16: return nf4 ? nf4_quantize_bs<BF16>(a, b0, b1) : int8_quantize_bs<BF16>(a, b0, b1);
    case DType::kFloat16: return nf4 ? nf4_quantize_bs<F16>(a, b0, b1) : int8_quantize_bs<F16>(a, b0, b1);
    default: return nf4 ? nf4_quantize_bs<float>(a, b0, b1) : int8_quantize_bs<float>(a, b0, b1);
  }
}

void TS_ISA_FN(dequantize_range)(const QuantArgs& a, int64_t e0, int64_t e1) {
  const bool nf4 = a.format == QuantFormat::kNF4;
  switch (a.dtype) {
    case DType::kBFloat16: return nf4 ? nf4_dequantize<BF16>(a, e0, e1) : int8_dequantize<BF16>(a, e0, e1);
    case DType::kFloat16: return nf4 ? nf4_dequantize<F16>(a, e0, e1) : int8_dequantize<F16>(a, e0, e1);
    default: return nf4 ? nf4_dequantize<float>(a, e0, e1) : int8_dequantize<float>(a, e0, e1);
  }
}

}  // namespace trainstream
