# The CPU kernel is compiled once per build (seqpar::cpu_kernels): the library's objects define
# its per-instruction-set copies, and programs that run the kernel define none of them in their
# own objects (they call the library's). Run by ctest with
#   -DNM=<nm> -DLIBRARY=<libseqpar_cpu_kernels.a> -DOBJECTS=<the program's objects, ;-list>
# or, for a program that compiles only some of the library's files itself (seqpar_demo built
# alone), with
#   -DNM=<nm> -DCALLERS=<the program's objects> -DPROVIDERS=<the library objects it compiles>
# to check that every entry point into the kernel the program calls is defined by those files.
cmake_policy(VERSION 3.20)  # IN_LIST
if(CALLERS OR PROVIDERS)
  set(required NM CALLERS PROVIDERS)
else()
  set(required NM LIBRARY OBJECTS)
endif()
foreach(var IN LISTS required)
  if(NOT ${var})
    message(FATAL_ERROR "compiled_kernels_check: -D${var}=... is required")
  endif()
endforeach()

# Symbols of `file` that it defines (`which` --defined-only; weak ones too: template instances
# are emitted weak) or calls without defining (--undefined-only).
function(symbols which file out)
  execute_process(COMMAND "${NM}" "${which}" "${file}" OUTPUT_VARIABLE text RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "compiled_kernels_check: ${NM} ${file} failed (${rc})")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# Mangled names of the three entry points and of the copies' namespaces.
set(entry_points "13forward_tasks|14backward_tasks|12decode_tasks")
set(pattern "${entry_points}|10isa_avx512|8isa_avx2|10isa_vec128")

if(CALLERS)
  # nm prints a symbol as its last field: keep that field of the entry points' lines.
  function(entry_point_names which files out)
    set(names "")
    foreach(file IN LISTS files)
      symbols(${which} "${file}" text)
      string(REGEX MATCHALL "[^ \n]*(${entry_points})[^\n]*" found "${text}")
      list(APPEND names ${found})
    endforeach()
    list(REMOVE_DUPLICATES names)
    set(${out} "${names}" PARENT_SCOPE)
  endfunction()
  entry_point_names(--undefined-only "${CALLERS}" called)
  entry_point_names(--defined-only "${PROVIDERS}" defined)
  list(LENGTH called count)
  if(count EQUAL 0)
    message(FATAL_ERROR "compiled_kernels_check: ${CALLERS} call no entry point into the kernel")
  endif()
  foreach(name IN LISTS called)
    if(NOT name IN_LIST defined)
      message(FATAL_ERROR "compiled_kernels_check: '${name}' is called by ${CALLERS} but defined by none of "
                          "${PROVIDERS}: add its element type's file where the program compiles the kernel")
    endif()
  endforeach()
  message(STATUS "compiled_kernels_check: the ${count} entry points ${CALLERS} call are in ${PROVIDERS}")
  return()
endif()
symbols(--defined-only "${LIBRARY}" library)
string(REGEX MATCHALL "[^\n]*(${pattern})[^\n]*" in_library "${library}")
list(LENGTH in_library count)
if(count LESS 4)
  message(FATAL_ERROR "compiled_kernels_check: ${LIBRARY} defines ${count} of the kernel's entry points; "
                      "expected every element type's")
endif()
foreach(object IN LISTS OBJECTS)
  symbols(--defined-only "${object}" symbols)
  string(REGEX MATCHALL "[^\n]*(${pattern})[^\n]*" own "${symbols}")
  if(own)
    list(GET own 0 first)
    message(FATAL_ERROR "compiled_kernels_check: ${object} compiles the CPU kernel itself (e.g. '${first}'): "
                        "its extern template declarations (kernel/cpu/compiled_kernels.hpp) did not cover it")
  endif()
endforeach()
message(STATUS "compiled_kernels_check: ${count} kernel symbols in the library, none in ${OBJECTS}")
