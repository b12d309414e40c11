# seqpar::cuda and seqpar::nccl: the CUDA backend (CudaFlashKernel, TensorOps<CudaSpace>,
# the device-memory ThreadCommunicator) and NcclCommunicator. Included from the top-level
# CMakeLists.txt. Both are INTERFACE targets: the library stays header-only, and a consumer's
# own .cu files compile the kernels they use.
#
# SEQPAR_ENABLE_CUDA / SEQPAR_ENABLE_NCCL: ON (fail if missing), OFF, or AUTO (if found).
# SEQPAR_ENABLE_CUDA defaults to AUTO at the top level and OFF as a subproject (CMakeLists.txt).
# The CUDA language is enabled only when nvcc is found, so a host-only build never needs it.
# Unless the caller sets CMAKE_CUDA_ARCHITECTURES, CUDA code targets sm_80 (SASS) and sm_90
# (SASS + PTX, so newer GPUs can JIT it): explicit, never whatever nvcc defaults to.

set(SEQPAR_HAS_CUDA OFF)
set(SEQPAR_HAS_NCCL OFF)

if(NOT SEQPAR_ENABLE_CUDA MATCHES "^(ON|OFF|AUTO)$")
  message(FATAL_ERROR "SEQPAR_ENABLE_CUDA: expected ON, OFF or AUTO, got '${SEQPAR_ENABLE_CUDA}'")
endif()
if(NOT SEQPAR_ENABLE_NCCL MATCHES "^(ON|OFF|AUTO)$")
  message(FATAL_ERROR "SEQPAR_ENABLE_NCCL: expected ON, OFF or AUTO, got '${SEQPAR_ENABLE_NCCL}'")
endif()
if(SEQPAR_ENABLE_NCCL STREQUAL "ON" AND SEQPAR_ENABLE_CUDA STREQUAL "OFF")
  message(FATAL_ERROR "SEQPAR_ENABLE_NCCL=ON needs CUDA, but SEQPAR_ENABLE_CUDA=OFF")
endif()

if(NOT SEQPAR_ENABLE_CUDA STREQUAL "OFF")
  # nvcc is often installed but not on PATH: look in the usual places before giving up.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(SEQPAR_NVCC nvcc
      HINTS ENV CUDA_HOME ENV CUDA_PATH ENV CUDAToolkit_ROOT
      PATH_SUFFIXES bin
      PATHS /usr/local/cuda/bin /opt/cuda/bin)
    if(SEQPAR_NVCC)
      set(CMAKE_CUDA_COMPILER "${SEQPAR_NVCC}" CACHE FILEPATH "CUDA compiler")
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(SEQPAR_DEFAULT_CUDA_ARCHITECTURES "80-real;90")
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES "${SEQPAR_DEFAULT_CUDA_ARCHITECTURES}" CACHE STRING
          "CUDA architectures (seqpar default: sm_80 SASS, sm_90 SASS + PTX)")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit)
  endif()
  if(CMAKE_CUDA_COMPILER AND CUDAToolkit_FOUND)
    set(SEQPAR_HAS_CUDA ON)
  elseif(SEQPAR_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SEQPAR_ENABLE_CUDA=ON but no CUDA compiler or toolkit was found "
                        "(set CMAKE_CUDA_COMPILER or CUDACXX to nvcc)")
  else()
    message(STATUS "seqpar: CUDA not found; seqpar::cuda and seqpar::nccl are not built")
  endif()
endif()

# seqpar_local_cuda_architectures(out override): the architectures for seqpar's own GPU
# programs (tests, benchmark, examples), which can run only on this machine: `override` if set,
# else CMAKE_CUDA_ARCHITECTURES when the caller chose it, else this machine's GPUs (nvidia-smi,
# sm_80 and newer), else 90-virtual alone: on a machine without a GPU (CI) they are only checked
# to compile, and PTX alone skips ptxas, a third of nvcc's time on the kernel instances (69 s
# instead of 110 s for the bf16 ones); the driver JIT-compiles that PTX on any sm_90 or newer GPU
# should such a build ever run on one.
function(seqpar_local_cuda_architectures out override)
  set(archs "${override}")
  if(NOT archs AND NOT CMAKE_CUDA_ARCHITECTURES STREQUAL "${SEQPAR_DEFAULT_CUDA_ARCHITECTURES}")
    set(archs "${CMAKE_CUDA_ARCHITECTURES}")
  endif()
  if(NOT archs)
    execute_process(COMMAND nvidia-smi --query-gpu=compute_cap --format=csv,noheader
      OUTPUT_VARIABLE caps RESULT_VARIABLE smi_rc ERROR_QUIET TIMEOUT 20)
    if(smi_rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${caps}")
      foreach(cap IN LISTS caps)
        string(REPLACE "." "" arch "${cap}")
        if(arch GREATER_EQUAL 80)  # seqpar's CUDA code targets sm_80 and newer
          list(APPEND archs "${arch}-real")
        endif()
      endforeach()
      list(REMOVE_DUPLICATES archs)
    endif()
  endif()
  if(NOT archs)
    set(archs "90-virtual")
  endif()
  set(${out} "${archs}" PARENT_SCOPE)
endfunction()

if(SEQPAR_HAS_CUDA)
  add_library(seqpar_cuda INTERFACE)
  add_library(seqpar::cuda ALIAS seqpar_cuda)
  set_target_properties(seqpar_cuda PROPERTIES EXPORT_NAME cuda)
  target_link_libraries(seqpar_cuda INTERFACE seqpar CUDA::cudart)
  # C++20 in CUDA sources; CMake < 3.26 does not know that nvcc 12+ supports it, so say it directly.
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    target_compile_features(seqpar_cuda INTERFACE cuda_std_20)
  else()
    target_compile_options(seqpar_cuda INTERFACE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  target_compile_definitions(seqpar_cuda INTERFACE SEQPAR_HAS_CUDA=1)
  # merge_row is a constexpr function the device code shares. Warning 554 is nvcc noting that
  # TensorView<const T>'s conversion to itself is never used (it is constrained away).
  target_compile_options(seqpar_cuda INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -diag-suppress=554>)
  message(STATUS "seqpar: seqpar::cuda with ${CMAKE_CUDA_COMPILER} (CUDA ${CUDAToolkit_VERSION}), "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES}")

  if(NOT SEQPAR_ENABLE_NCCL STREQUAL "OFF")
    # NCCL ships with the toolkit here, or on its own (NCCL_ROOT / NCCL_HOME).
    find_path(SEQPAR_NCCL_INCLUDE_DIR nccl.h
      HINTS ENV NCCL_ROOT ENV NCCL_HOME ${CUDAToolkit_INCLUDE_DIRS}
      PATH_SUFFIXES include)
    # libnccl.so.2: the pip wheel ships no unversioned link.
    find_library(SEQPAR_NCCL_LIBRARY NAMES nccl libnccl.so.2
      HINTS ENV NCCL_ROOT ENV NCCL_HOME ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}
      PATH_SUFFIXES lib lib64)
    if(SEQPAR_NCCL_INCLUDE_DIR AND SEQPAR_NCCL_LIBRARY)
      set(SEQPAR_HAS_NCCL ON)
      add_library(seqpar_nccl INTERFACE)
      add_library(seqpar::nccl ALIAS seqpar_nccl)
      set_target_properties(seqpar_nccl PROPERTIES EXPORT_NAME nccl)
      target_include_directories(seqpar_nccl SYSTEM INTERFACE ${SEQPAR_NCCL_INCLUDE_DIR})
      target_link_libraries(seqpar_nccl INTERFACE seqpar_cuda ${SEQPAR_NCCL_LIBRARY})
      target_compile_definitions(seqpar_nccl INTERFACE SEQPAR_HAS_NCCL=1)
      message(STATUS "seqpar: seqpar::nccl with ${SEQPAR_NCCL_LIBRARY}")
    elseif(SEQPAR_ENABLE_NCCL STREQUAL "ON")
      message(FATAL_ERROR "SEQPAR_ENABLE_NCCL=ON but nccl.h / libnccl were not found (set NCCL_ROOT)")
    else()
      message(STATUS "seqpar: NCCL not found; seqpar::nccl is not built")
    endif()
  endif()
elseif(SEQPAR_ENABLE_NCCL STREQUAL "ON")
  message(FATAL_ERROR "SEQPAR_ENABLE_NCCL=ON needs CUDA, which was not found")
endif()

# The CUDA examples (examples/cuda) are added by examples/CMakeLists.txt and build only when
# seqpar::cuda (nccl_demo: seqpar::nccl and seqpar::mpi) exists.
