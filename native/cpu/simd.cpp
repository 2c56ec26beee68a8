// Which SIMD build of the kernel files runs: the best this CPU supports, unless a test
// forces a lower one.
#include <atomic>
#include <string>

#include "trainstream/common.h"
#include "trainstream/simd.h"

namespace trainstream {

SimdLevel best_simd_level() {
#ifdef TS_HAVE_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return SimdLevel::kAVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return SimdLevel::kAVX2;
#endif
  return SimdLevel::kScalar;
}

static std::atomic<int>& active_level_storage() {
  static std::atomic<int> level{static_cast<int>(best_simd_level())};
  return level;
}

SimdLevel active_simd_level() { return static_cast<SimdLevel>(active_level_storage().load()); }

void set_simd_level(SimdLevel level) {
  TS_CHECK_ARG(static_cast<int>(level) <= static_cast<int>(best_simd_level()),
               std::string("this CPU does not support SIMD level ") + simd_name(level) +
                   " (best available: " + simd_name(best_simd_level()) + ")");
  active_level_storage().store(static_cast<int>(level));
}

const char* simd_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAVX512: return "avx512";
    case SimdLevel::kAVX2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace trainstream
