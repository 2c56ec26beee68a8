// Run-time choice among the builds of the SIMD kernel files.
//
// Each file under native/cpu/*_simd.cpp is compiled once per level (CMake's
// ts_add_simd_kernels), with TS_ISA set to scalar, avx2 or avx512; TS_ISA_FN(name) gives
// each build's entry points distinct names (name_scalar, name_avx2, name_avx512), and
// TS_DECLARE_SIMD / ts_pick choose one at run time.
#pragma once

#define TS_CAT2(a, b) a##_##b
#define TS_CAT(a, b) TS_CAT2(a, b)
#define TS_ISA_FN(name) TS_CAT(name, TS_ISA)

namespace trainstream {

// SIMD levels, best last. "scalar" still lets the compiler use the baseline SSE2.
enum class SimdLevel : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };
SimdLevel best_simd_level();           // what this CPU supports
SimdLevel active_simd_level();         // what the kernels use now
void set_simd_level(SimdLevel level);  // for tests: force a lower level; ArgumentError if unsupported
const char* simd_name(SimdLevel level);

}  // namespace trainstream

#ifdef TS_HAVE_X86_SIMD
// Declares name_scalar, name_avx2 and name_avx512, given a function type alias
// (`using Sig = void(int);`, not a pointer type).
#define TS_DECLARE_SIMD(type, name) \
  type TS_CAT(name, scalar);        \
  type TS_CAT(name, avx2);          \
  type TS_CAT(name, avx512)
#define TS_PICK_SIMD(name)                                                            \
  (::trainstream::active_simd_level() == ::trainstream::SimdLevel::kAVX512 ? &TS_CAT(name, avx512) \
   : ::trainstream::active_simd_level() == ::trainstream::SimdLevel::kAVX2 ? &TS_CAT(name, avx2)   \
                                                                           : &TS_CAT(name, scalar))
#else
#define TS_DECLARE_SIMD(type, name) type TS_CAT(name, scalar)
#define TS_PICK_SIMD(name) (&TS_CAT(name, scalar))
#endif
