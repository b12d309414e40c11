# Install and export: the headers, one export set per target (seqpar, and the optional mpi,
# cuda and nccl components), seqparConfig.cmake and an arch-independent version file, so that
#   find_package(seqpar CONFIG REQUIRED COMPONENTS mpi nccl)
# finds the library and its dependencies after `cmake --install`. Included at the end of the
# top-level CMakeLists.txt.
#
# Why one export set per component: a consumer that asks only for seqpar::seqpar must not need
# MPI, CUDA or NCCL to be found; the config loads a component's targets only when asked.

include(CMakePackageConfigHelpers)

option(SEQPAR_INSTALL "Generate the install rules (headers, CMake package)" ${PROJECT_IS_TOP_LEVEL})
if(NOT SEQPAR_INSTALL)
  return()
endif()

# Header-only: the package is the same for every architecture, so it goes under share/.
set(SEQPAR_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/seqpar"
    CACHE STRING "Where seqparConfig.cmake is installed (relative to the prefix)")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/seqpar"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.cuh" PATTERN "*.h" PATTERN "*.inl")

install(TARGETS seqpar EXPORT seqparTargets)
install(EXPORT seqparTargets NAMESPACE seqpar:: DESTINATION "${SEQPAR_INSTALL_CMAKEDIR}")

# Components that this build has; the config refuses the others with the reason.
set(SEQPAR_BUILT_COMPONENTS "")
foreach(component IN ITEMS mpi cuda nccl)
  if(TARGET seqpar_${component})
    install(TARGETS seqpar_${component} EXPORT seqpar-${component}Targets)
    install(EXPORT seqpar-${component}Targets NAMESPACE seqpar:: DESTINATION "${SEQPAR_INSTALL_CMAKEDIR}")
    list(APPEND SEQPAR_BUILT_COMPONENTS ${component})
  endif()
endforeach()
# NCCL has no CMake package of its own: the config checks that the library this build found is
# still where it was.
set(SEQPAR_NCCL_LIBRARY_FOR_CONFIG "${SEQPAR_NCCL_LIBRARY}")

configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/seqparConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/seqparConfig.cmake"
  INSTALL_DESTINATION "${SEQPAR_INSTALL_CMAKEDIR}")
# 0.x: a new minor version may break the API, so only the same major.minor is compatible.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/seqparConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/seqparConfig.cmake" "${PROJECT_BINARY_DIR}/seqparConfigVersion.cmake"
        DESTINATION "${SEQPAR_INSTALL_CMAKEDIR}")
