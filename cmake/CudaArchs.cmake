# The one place for GPU-architecture policy.
#
#   TRAINSTREAM_CUDA_ARCHS=native  (default; local builds): the GPUs nvidia-smi reports;
#                                  with no GPU visible, the wheel list below.
#   TRAINSTREAM_CUDA_ARCHS=wheel   (CI wheels): sm_75 through the newest architecture this
#                                  toolkit knows (desktop and data-center parts), the newest
#                                  also embedded as PTX so future GPUs can JIT it.
#   TRAINSTREAM_CUDA_ARCHS=80;90   an explicit CMake list, used as given.
#
# The CUDA major itself is checked by cmake/CudaMajor.cmake, in every build.
set(TRAINSTREAM_CUDA_ARCHS "native" CACHE STRING "native, wheel, or a CMake CUDA_ARCHITECTURES list")

# Data-center and desktop architectures; embedded parts (87, 88, 101, 110) are left out.
set(_ts_family 75 80 86 89 90 100 103 120 121)

execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --list-gpu-arch
  OUTPUT_VARIABLE _ts_known RESULT_VARIABLE _ts_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _ts_rc EQUAL 0)
  message(FATAL_ERROR "could not run '${CMAKE_CUDA_COMPILER} --list-gpu-arch'")
endif()
string(REGEX MATCHALL "compute_[0-9]+" _ts_known "${_ts_known}")
string(REPLACE "compute_" "" _ts_known "${_ts_known}")

set(_ts_wheel "")
foreach(a IN LISTS _ts_family)
  if(a IN_LIST _ts_known)
    list(APPEND _ts_wheel ${a})
  endif()
endforeach()
list(GET _ts_wheel -1 _ts_newest)
set(_ts_wheel_archs "")
foreach(a IN LISTS _ts_wheel)
  if(a STREQUAL _ts_newest)
    list(APPEND _ts_wheel_archs ${a})          # real and virtual: SASS + PTX
  else()
    list(APPEND _ts_wheel_archs ${a}-real)
  endif()
endforeach()

if(TRAINSTREAM_CUDA_ARCHS STREQUAL "native")
  find_program(_ts_smi nvidia-smi)
  set(_ts_native "")
  if(_ts_smi)
    execute_process(COMMAND ${_ts_smi} --query-gpu=compute_cap --format=csv,noheader
      OUTPUT_VARIABLE _ts_caps RESULT_VARIABLE _ts_smi_rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_ts_smi_rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" _ts_caps "${_ts_caps}")
      foreach(c IN LISTS _ts_caps)
        string(REPLACE "." "" c "${c}")
        list(APPEND _ts_native ${c}-real)
      endforeach()
      list(REMOVE_DUPLICATES _ts_native)
    endif()
  endif()
  if(_ts_native)
    set(CMAKE_CUDA_ARCHITECTURES ${_ts_native})
  else()
    message(STATUS "TrainStream: no GPU visible; building the wheel architecture list")
    set(CMAKE_CUDA_ARCHITECTURES ${_ts_wheel_archs})
  endif()
elseif(TRAINSTREAM_CUDA_ARCHS STREQUAL "wheel")
  set(CMAKE_CUDA_ARCHITECTURES ${_ts_wheel_archs})
else()
  set(CMAKE_CUDA_ARCHITECTURES ${TRAINSTREAM_CUDA_ARCHS})
endif()

# CMAKE_CUDA_COMPILER_VERSION is only known after enable_language; ask nvcc directly.
execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --version OUTPUT_VARIABLE _ts_nvcc_version)
string(REGEX MATCH "release ([0-9]+)\\.([0-9]+)" _ts_m "${_ts_nvcc_version}")
set(TS_NVCC_MAJOR ${CMAKE_MATCH_1})

string(REPLACE ";" " " TS_CUDA_ARCHS_DESCRIPTION "${CMAKE_CUDA_ARCHITECTURES}")
message(STATUS "TrainStream: CUDA ${TS_NVCC_MAJOR}, architectures ${TS_CUDA_ARCHS_DESCRIPTION}")
