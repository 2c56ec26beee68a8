# Compiler flags in one place.
#
# Numerics: -ffp-contract=off keeps a*b+c as two rounded operations, so the scalar, AVX2
# and AVX-512 builds of a kernel and the pure-torch twin in ops/reference.py produce the
# same bits. -fno-math-errno lets sqrt vectorize (it changes no result).

if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  set(TS_X86 ON)
endif()

set(TS_COMMON_FLAGS -O3 -ffp-contract=off -fno-math-errno -Wall -Wextra)

function(ts_apply_common_flags target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${TS_COMMON_FLAGS}>)
endfunction()

# One object library per SIMD level for kernel sources that are written once.
#   ts_add_simd_kernels(<target> scalar|avx2|avx512 <sources>...)
function(ts_add_simd_kernels target level)
  add_library(${target} OBJECT ${ARGN})
  target_include_directories(${target} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/native/include)
  target_compile_definitions(${target} PRIVATE TS_ISA=${level})
  set_target_properties(${target} PROPERTIES CXX_VISIBILITY_PRESET hidden)
  ts_apply_common_flags(${target})
  if(level STREQUAL "avx2")
    target_compile_options(${target} PRIVATE -mavx2 -mfma -mf16c)
  elseif(level STREQUAL "avx512")
    target_compile_options(${target} PRIVATE -mavx512f -mavx512bw -mavx512vl -mavx512dq
      -mavx2 -mfma -mf16c -mprefer-vector-width=512)
  elseif(NOT level STREQUAL "scalar")
    message(FATAL_ERROR "unknown SIMD level ${level}")
  endif()
  if(TRAINSTREAM_VEC_REPORT)
    target_compile_options(${target} PRIVATE -fopt-info-vec-optimized)
  endif()
endfunction()
