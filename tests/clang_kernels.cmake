# The CPU kernels as Clang compiles them: Clang has its own vector builtins, target attributes
# (`#pragma clang attribute`) and CPU feature checks, and GCC builds everything else here, so
# a GCC-only construct in the kernels would otherwise go unseen. Builds tests/test_bf16.cpp
# (every instruction-set level this CPU runs: their conversions, packs and transposes, the
# forward and backward) with CLANGXX, warnings as errors, and runs it.
# Args: -DCLANGXX= -DSOURCE=<repository root> -DDOCTEST=<doctest include dir> -DOUT=<program path>
execute_process(
  COMMAND "${CLANGXX}" -std=c++20 -O2 -DNDEBUG -Wall -Wextra -Werror -pthread "-I${SOURCE}/include" "-I${SOURCE}/tests"
          -idirafter "${DOCTEST}" "${SOURCE}/tests/support/doctest_main.cpp" "${SOURCE}/tests/test_bf16.cpp" -o "${OUT}"
  RESULT_VARIABLE built)
if(NOT built EQUAL 0)
  message(FATAL_ERROR "clang_kernels: ${CLANGXX} could not build tests/test_bf16.cpp")
endif()
execute_process(COMMAND "${OUT}" RESULT_VARIABLE ran)
if(NOT ran EQUAL 0)
  message(FATAL_ERROR "clang_kernels: test_bf16 built by ${CLANGXX} failed")
endif()
