# The CPU kernel is compiled once per build (seqpar::cpu_kernels): the library's objects define
# its per-instruction-set copies, and programs that run the kernel define none of them in their
# own objects (they call the library's). Run by ctest with
#   -DNM=<nm> -DLIBRARY=<libseqpar_cpu_kernels.a> -DOBJECTS=<the program's objects, ;-list>
foreach(var NM LIBRARY OBJECTS)
  if(NOT ${var})
    message(FATAL_ERROR "compiled_kernels_check: -D${var}=... is required")
  endif()
endforeach()

# Defined text symbols of `file` (weak ones too: template instances are emitted weak).
function(defined_symbols file out)
  execute_process(COMMAND "${NM}" --defined-only "${file}" OUTPUT_VARIABLE text RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "compiled_kernels_check: ${NM} ${file} failed (${rc})")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# Mangled names of the three entry points and of the copies' namespaces.
set(pattern "14forward_tasks|15backward_tasks|12decode_tasks|10isa_avx512|8isa_avx2|10isa_vec128")
defined_symbols("${LIBRARY}" library)
string(REGEX MATCHALL "[^\n]*(${pattern})[^\n]*" in_library "${library}")
list(LENGTH in_library count)
if(count LESS 4)
  message(FATAL_ERROR "compiled_kernels_check: ${LIBRARY} defines ${count} of the kernel's entry points; "
                      "expected every element type's")
endif()
foreach(object IN LISTS OBJECTS)
  defined_symbols("${object}" symbols)
  string(REGEX MATCHALL "[^\n]*(${pattern})[^\n]*" own "${symbols}")
  if(own)
    list(GET own 0 first)
    message(FATAL_ERROR "compiled_kernels_check: ${object} compiles the CPU kernel itself (e.g. '${first}'): "
                        "its extern template declarations (kernel/cpu/compiled_kernels.hpp) did not cover it")
  endif()
endforeach()
message(STATUS "compiled_kernels_check: ${count} kernel symbols in the library, none in ${OBJECTS}")
