# Driver of the packaging tests, run by ctest in script mode:
#   cmake -DMODE=<fetchcontent|subdirectory|find_package|quickstart> -DSOURCE=<seqpar tree>
#         -DWORK=<scratch dir> -DGENERATOR=<generator> -DMAKE_PROGRAM=<make or ninja>
#         -DCXX=<compiler> -DVERSION=<seqpar version> [-DWITH_MPI=ON] [-DWITH_NCCL=ON] -P run.cmake
# Each mode configures a fresh consumer project the way a user would, builds it and runs its
# program. Nested builds are kept lean (one .cpp, no CUDA detection, MPI only where the mode
# tests it, and no build type: these tests check how seqpar is found, configured and linked, not
# its speed, and an unoptimised consumer compiles in 40% of a Release one's CPU time; the
# project's own build compiles every header optimised): they dominate the time of these tests.
cmake_minimum_required(VERSION 3.21)

foreach(var MODE SOURCE WORK GENERATOR CXX VERSION)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake: -D${var}=... is required")
  endif()
endforeach()
foreach(var WITH_MPI WITH_NCCL)
  if(NOT DEFINED ${var})
    set(${var} OFF)
  endif()
endforeach()

set(project_dir "${CMAKE_CURRENT_LIST_DIR}/project")
set(common -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX}" -DCMAKE_BUILD_TYPE=
    -DSEQPAR_ENABLE_CUDA=OFF -DSEQPAR_ENABLE_NCCL=OFF)
if(MAKE_PROGRAM)
  list(APPEND common "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()

# Runs a command; fails with its output. The output is left in `step_output`.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc}):\n${out}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

# Configures, builds and runs a consumer project from scratch.
function(build_and_run what src bin exe)
  file(REMOVE_RECURSE "${bin}")
  run_step("${what}: configure" "${CMAKE_COMMAND}" -S "${src}" -B "${bin}" ${common} ${ARGN})
  run_step("${what}: build" "${CMAKE_COMMAND}" --build "${bin}")
  run_step("${what}: run" "${bin}/${exe}")
  string(STRIP "${step_output}" printed)
  message(STATUS "${what}: ${printed}")
  set(step_output "${step_output}" PARENT_SCOPE)
endfunction()

# Fails unless `text` (a program's output) contains `needle`.
function(expect_match what needle text)
  string(FIND "${text}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: its output lacks \"${needle}\":\n${text}")
  endif()
endfunction()

# Configures a consumer project that must be refused, with a message containing `needle`.
function(expect_refusal what needle src bin)
  file(REMOVE_RECURSE "${bin}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${src}" -B "${bin}" ${common} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${what}: configure succeeded, but must fail")
  endif()
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}")  # CMake wraps long messages
  string(FIND "${flat}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: failed without saying \"${needle}\":\n${out}")
  endif()
  message(STATUS "${what}: refused as expected (\"${needle}\")")
endfunction()

# The text between `<!-- quickstart:NAME -->` and `<!-- /quickstart -->`, inside its ``` fence.
function(readme_block readme name out)
  set(open "<!-- quickstart:${name} -->")
  string(FIND "${readme}" "${open}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "README.md has no '${open}' ... '<!-- /quickstart -->' block, so its quick start "
                        "cannot be tested (the README must keep both quickstart blocks: CMakeLists.txt and main.cpp)")
  endif()
  string(LENGTH "${open}" n)
  math(EXPR at "${at} + ${n}")
  string(SUBSTRING "${readme}" ${at} -1 rest)
  string(FIND "${rest}" "<!-- /quickstart -->" end)
  if(end EQUAL -1)
    message(FATAL_ERROR "README.md: the '${open}' block is not closed by '<!-- /quickstart -->'")
  endif()
  string(SUBSTRING "${rest}" 0 ${end} block)
  string(FIND "${block}" "```" fence)
  if(fence EQUAL -1)
    message(FATAL_ERROR "README.md: the '${open}' block has no ``` code fence")
  endif()
  string(SUBSTRING "${block}" ${fence} -1 block)
  string(FIND "${block}" "\n" line_end)
  math(EXPR line_end "${line_end} + 1")
  string(SUBSTRING "${block}" ${line_end} -1 block)  # drops the opening fence line (```cmake)
  string(FIND "${block}" "```" fence)
  if(fence EQUAL -1)
    message(FATAL_ERROR "README.md: the '${open}' code fence is not closed")
  endif()
  string(SUBSTRING "${block}" 0 ${fence} block)
  set(${out} "${block}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")

if(MODE STREQUAL "fetchcontent")
  # A release-style archive of the tree (only what a consumer build reads), fetched by URL.
  set(stage "${WORK}/stage/seqpar-${VERSION}")
  file(COPY "${SOURCE}/CMakeLists.txt" "${SOURCE}/cmake" "${SOURCE}/include" "${SOURCE}/src" DESTINATION "${stage}")
  run_step("archive" "${CMAKE_COMMAND}" -E tar czf "${WORK}/seqpar-${VERSION}.tar.gz" "seqpar-${VERSION}"
           WORKING_DIRECTORY "${WORK}/stage")
  build_and_run("FetchContent (URL file://)" "${project_dir}" "${WORK}/build" consumer
                -DSEQPAR_CONSUME=fetchcontent "-DSEQPAR_URL=file://${WORK}/seqpar-${VERSION}.tar.gz"
                -DSEQPAR_ENABLE_MPI=OFF)

elseif(MODE STREQUAL "subdirectory")
  build_and_run("add_subdirectory" "${project_dir}" "${WORK}/build" consumer
                -DSEQPAR_CONSUME=subdirectory "-DSEQPAR_SOURCE=${SOURCE}" -DSEQPAR_ENABLE_MPI=OFF)

elseif(MODE STREQUAL "find_package")
  # Installs seqpar configured like `cmake -S <src> -B <bin> <args>` into <prefix>.
  function(install_seqpar bin prefix)
    run_step("configure seqpar" "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${bin}" -G "${GENERATOR}"
             "-DCMAKE_CXX_COMPILER=${CXX}" -DCMAKE_BUILD_TYPE=Release -DSEQPAR_BUILD_TESTS=OFF
             -DSEQPAR_BUILD_EXAMPLES=OFF -DSEQPAR_BUILD_BENCHMARKS=OFF -DSEQPAR_INSTALL=ON ${ARGN})
    run_step("install seqpar" "${CMAKE_COMMAND}" --install "${bin}" --prefix "${prefix}")
  endfunction()

  # With every component this machine's build has (WITH_MPI, WITH_NCCL).
  set(prefix "${WORK}/prefix")
  set(components "")
  set(enable -DSEQPAR_ENABLE_MPI=${WITH_MPI} -DSEQPAR_ENABLE_CUDA=${WITH_NCCL} -DSEQPAR_ENABLE_NCCL=${WITH_NCCL})
  if(WITH_MPI)
    list(APPEND components mpi)
  endif()
  if(WITH_NCCL)
    list(APPEND components nccl)
  endif()
  install_seqpar("${WORK}/seqpar-build" "${prefix}" ${enable})
  foreach(file include/seqpar/seqpar.hpp include/seqpar/attention.hpp share/cmake/seqpar/seqparConfig.cmake
               share/cmake/seqpar/seqparConfigVersion.cmake share/cmake/seqpar/seqparTargets.cmake)
    if(NOT EXISTS "${prefix}/${file}")
      message(FATAL_ERROR "install: ${file} is missing under ${prefix}")
    endif()
  endforeach()

  # Arch-independent: a consumer with another pointer size (a 32-bit build) still matches.
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" major_minor "${VERSION}")
  set(PACKAGE_FIND_VERSION "${major_minor}")
  string(REPLACE "." ";" parts "${major_minor}")
  list(GET parts 0 PACKAGE_FIND_VERSION_MAJOR)
  list(GET parts 1 PACKAGE_FIND_VERSION_MINOR)
  set(PACKAGE_FIND_VERSION_PATCH 0)
  set(PACKAGE_FIND_VERSION_COUNT 2)
  set(CMAKE_SIZEOF_VOID_P 4)
  include("${prefix}/share/cmake/seqpar/seqparConfigVersion.cmake")
  if(PACKAGE_VERSION_UNSUITABLE OR NOT PACKAGE_VERSION_COMPATIBLE)
    message(FATAL_ERROR "seqparConfigVersion.cmake refuses a consumer with 4-byte pointers: it must be "
                        "ARCH_INDEPENDENT (header-only)")
  endif()
  unset(CMAKE_SIZEOF_VOID_P)

  string(REPLACE ";" " " shown "${components}")
  string(REPLACE ";" "," components "${components}")
  build_and_run("find_package(seqpar ${major_minor} CONFIG REQUIRED COMPONENTS ${shown})" "${project_dir}"
                "${WORK}/build" consumer -DSEQPAR_CONSUME=find_package "-DCMAKE_PREFIX_PATH=${prefix}"
                "-DSEQPAR_VERSION_WANTED=${major_minor}" "-DSEQPAR_COMPONENTS=${components}")

  # What must fail, and say why: against a host-only installation, so the same on every machine.
  set(bare "${WORK}/prefix-host-only")
  install_seqpar("${WORK}/seqpar-build-host-only" "${bare}" -DSEQPAR_ENABLE_MPI=OFF -DSEQPAR_ENABLE_CUDA=OFF
                 -DSEQPAR_ENABLE_NCCL=OFF)
  set(refuse_args -DSEQPAR_CONSUME=find_package "-DCMAKE_PREFIX_PATH=${bare}")
  expect_refusal("a component this installation lacks" "component 'mpi' was not built" "${project_dir}"
                 "${WORK}/refused" ${refuse_args} -DSEQPAR_COMPONENTS=mpi,nccl)
  expect_refusal("a component this installation lacks" "component 'nccl' was not built" "${project_dir}"
                 "${WORK}/refused" ${refuse_args} -DSEQPAR_COMPONENTS=mpi,nccl)
  expect_refusal("an unknown component" "unknown component 'gpu'" "${project_dir}" "${WORK}/refused"
                 ${refuse_args} -DSEQPAR_COMPONENTS=gpu)
  expect_refusal("an incompatible version" "compatible with requested version" "${project_dir}" "${WORK}/refused"
                 ${refuse_args} -DSEQPAR_VERSION_WANTED=99.0)

elseif(MODE STREQUAL "quickstart")
  # The README's quick start, pasted into a fresh project; FetchContent is pointed at this tree.
  # Both programs run and must say that they match the reference (the MPI one where this
  # build has MPI: WITH_MPI, MPIEXEC and MPIEXEC_FLAGS).
  file(READ "${SOURCE}/README.md" readme)
  foreach(name CMakeLists.txt hello_rank.hpp main.cpp main_mpi.cpp)
    readme_block("${readme}" "${name}" text)
    file(WRITE "${WORK}/src/${name}" "${text}")
  endforeach()
  file(READ "${WORK}/src/CMakeLists.txt" cmakelists)
  if(NOT cmakelists MATCHES "FetchContent_Declare\\(seqpar")
    message(FATAL_ERROR "README.md quick start: its CMakeLists.txt must get seqpar with FetchContent_Declare(seqpar ...)")
  endif()
  build_and_run("README quick start" "${WORK}/src" "${WORK}/build" hello_seqpar
                "-DFETCHCONTENT_SOURCE_DIR_SEQPAR=${SOURCE}" -DSEQPAR_ENABLE_MPI=${WITH_MPI})
  expect_match("README quick start" "matches the reference: yes" "${step_output}")
  if(WITH_MPI)
    set(ENV{OMPI_ALLOW_RUN_AS_ROOT} 1)
    set(ENV{OMPI_ALLOW_RUN_AS_ROOT_CONFIRM} 1)
    run_step("README quick start (MPI): run" "${MPIEXEC}" ${MPIEXEC_FLAGS} -np 4 "${WORK}/build/hello_seqpar_mpi")
    expect_match("README quick start (MPI)" "matches the reference: yes" "${step_output}")
    message(STATUS "README quick start (MPI, 4 processes): ok")
  endif()

else()
  message(FATAL_ERROR "run.cmake: MODE: expected fetchcontent, subdirectory, find_package or quickstart, got '${MODE}'")
endif()
