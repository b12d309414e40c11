# The ctest doxygen_no_warnings: runs doxygen with the repository's Doxyfile, writing into a
# scratch directory instead of docs/api, and fails on any warning (printing them all).
#   cmake -DDOXYGEN=<doxygen> -DSOURCE=<repository root> -DOUT=<scratch dir> -P check_doxygen.cmake
foreach(var DOXYGEN SOURCE OUT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_doxygen.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
file(READ "${SOURCE}/Doxyfile" config)
# Later assignments win: only the output places change.
string(APPEND config "\nOUTPUT_DIRECTORY = \"${OUT}\"\nWARN_LOGFILE = \"${OUT}/warnings.log\"\n")
file(WRITE "${OUT}/Doxyfile" "${config}")
execute_process(COMMAND "${DOXYGEN}" "${OUT}/Doxyfile" WORKING_DIRECTORY "${SOURCE}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "doxygen failed (exit ${rc}):\n${out}${err}")
endif()
file(READ "${OUT}/warnings.log" warnings)
string(STRIP "${warnings}${err}" warnings)
if(NOT warnings STREQUAL "")
  message(FATAL_ERROR "doxygen warnings (document every public name; see Doxyfile):\n${warnings}")
endif()
if(NOT EXISTS "${OUT}/html/index.html")
  message(FATAL_ERROR "doxygen wrote no ${OUT}/html/index.html")
endif()
message(STATUS "doxygen: no warnings")
