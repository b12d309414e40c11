# cmake -DCMD=<command;args> [-DREGEX=<regex>] [-DREGEX_ALL=<regex;regex...>] [-DNOT_REGEX=<regex>]
#       [-DEXPECT_FAILURE=ON | -DEXPECT_STATUS=N] -P run_expect.cmake
# Runs CMD, echoes its output, and fails unless its exit status is 0 (non-zero with
# EXPECT_FAILURE, N with EXPECT_STATUS), its output matches REGEX and every regex of REGEX_ALL
# (in any order), and it does not match NOT_REGEX. ctest's PASS_REGULAR_EXPRESSION alone would
# ignore the exit status.
execute_process(COMMAND ${CMD} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(DEFINED EXPECT_STATUS)
  if(NOT status EQUAL EXPECT_STATUS)
    message(FATAL_ERROR "expected exit status ${EXPECT_STATUS}, got ${status}")
  endif()
elseif(EXPECT_FAILURE)
  if(status EQUAL 0)
    message(FATAL_ERROR "expected a non-zero exit status, got 0")
  endif()
elseif(NOT status EQUAL 0)
  message(FATAL_ERROR "exit status ${status}")
endif()
if(REGEX AND NOT "${out}${err}" MATCHES "${REGEX}")
  message(FATAL_ERROR "output does not match: ${REGEX}")
endif()
foreach(each IN LISTS REGEX_ALL)
  if(NOT "${out}${err}" MATCHES "${each}")
    message(FATAL_ERROR "output does not match: ${each}")
  endif()
endforeach()
if(NOT_REGEX AND "${out}${err}" MATCHES "${NOT_REGEX}")
  message(FATAL_ERROR "output matches what it must not: ${NOT_REGEX}")
endif()
