# The CUDA major a distribution is named after, checked in every build.
#
# trainstream-cuXYZ carries kernels for CUDA X (cu130: 13, cu128: 12), and its Python side
# (trainstream/_distribution.py) tells users which one to install from that name alone, so a
# build whose nvcc has another major would ship wrong kernels under a right-looking name.
# The expected major comes from the name scikit-build-core passes (SKBUILD_PROJECT_NAME, as
# trainstream_cu130), or from TRAINSTREAM_EXPECT_CUDA_MAJOR for a plain CMake build; when both
# are given they must agree. Usable in script mode (cmake -P), which the release tests use.

# ts_cuda_major_from_name(<out> <distribution name>): X of trainstream-cuXYZ; empty for other names.
function(ts_cuda_major_from_name out name)
  set(major "")
  if(name MATCHES "^trainstream[-_]cu([0-9]+)[0-9]$")
    set(major ${CMAKE_MATCH_1})
  endif()
  set(${out} "${major}" PARENT_SCOPE)
endfunction()

# ts_expected_cuda_major(<out> <distribution name> <explicit major or "">): the major this
# build must have, or empty when nothing names one. FATAL_ERROR when the two disagree.
function(ts_expected_cuda_major out name explicit)
  ts_cuda_major_from_name(from_name "${name}")
  if(explicit AND from_name AND NOT explicit STREQUAL from_name)
    message(FATAL_ERROR "TRAINSTREAM_EXPECT_CUDA_MAJOR=${explicit}, but the distribution "
                        "${name} is named for CUDA ${from_name}")
  endif()
  if(explicit)
    set(${out} "${explicit}" PARENT_SCOPE)
  else()
    set(${out} "${from_name}" PARENT_SCOPE)
  endif()
endfunction()

# ts_check_cuda_major(<distribution name> <expected major or ""> <nvcc version>)
function(ts_check_cuda_major name expected nvcc_version)
  string(REGEX MATCH "^[0-9]+" nvcc_major "${nvcc_version}")
  if(expected AND NOT nvcc_major STREQUAL expected)
    message(FATAL_ERROR "${name} is the distribution for CUDA ${expected}, but the CUDA compiler "
                        "(${CMAKE_CUDA_COMPILER}) is CUDA ${nvcc_version}. Point CUDACXX at a CUDA "
                        "${expected}.x nvcc, or build the distribution named for CUDA ${nvcc_major}.")
  endif()
endfunction()
