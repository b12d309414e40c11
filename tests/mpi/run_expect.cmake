# cmake -DCMD=<command;args> [-DREGEX=<regex>] [-DEXPECT_FAILURE=ON | -DEXPECT_STATUS=N] -P run_expect.cmake
# Runs CMD, echoes its output, and fails unless its exit status is 0 (non-zero with
# EXPECT_FAILURE, N with EXPECT_STATUS) and its output matches REGEX. ctest's
# PASS_REGULAR_EXPRESSION alone would ignore the exit status.
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
