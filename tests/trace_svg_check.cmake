# The ctest trace_svg: test_trace writes a small 4-rank zigzag ring trace, tools/trace_svg.py
# draws it, and Python's own XML parser must read the SVG back with a bar per trace event.
#   cmake -DTEST_TRACE=<test_trace> -DPYTHON=<python3> -DSOURCE=<repository root> -DWORK=<dir> -P trace_svg_check.cmake
foreach(var TEST_TRACE PYTHON SOURCE WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "trace_svg_check.cmake: -D${var}=... is required")
  endif()
endforeach()
file(MAKE_DIRECTORY "${WORK}")
set(json "${WORK}/trace_ring_zigzag_4.json")
set(svg "${WORK}/trace_ring_zigzag_4.svg")
file(REMOVE "${json}" "${svg}")
execute_process(COMMAND "${CMAKE_COMMAND}" -E env "SEQPAR_TRACE_OUT=${json}" SEQPAR_TRACE_SEQ=512
                        "${TEST_TRACE}" "--test-case=*SEQPAR_TRACE_OUT*"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0 OR NOT EXISTS "${json}")
  message(FATAL_ERROR "test_trace wrote no trace (exit ${rc}):\n${out}")
endif()
execute_process(COMMAND "${PYTHON}" "${SOURCE}/tools/trace_svg.py" "${json}" -o "${svg}" --width 900
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "trace_svg.py failed (exit ${rc}):\n${out}")
endif()
set(check [=[
import json, sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[2]).getroot()
ns = "{http://www.w3.org/2000/svg}"
assert root.tag == ns + "svg", root.tag
events = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"] == "X"]
titles = [t.text for t in root.iter(ns + "title")]
assert len(titles) == len(events), (len(titles), len(events))
ranks = [t.text for t in root.iter(ns + "text") if (t.text or "").startswith("rank ")]
assert ranks == ["rank 0", "rank 1", "rank 2", "rank 3"], ranks
print("svg: %d bars, %s" % (len(titles), ", ".join(ranks)))
]=])
execute_process(COMMAND "${PYTHON}" -c "${check}" "${json}" "${svg}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message(STATUS "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the SVG is not what the trace holds (exit ${rc})")
endif()
