# ms_module(NAME SOURCES ... DEPS ...): one static library per lib/<NAME>/ folder.
function(ms_module name)
  cmake_parse_arguments(M "" "" "SOURCES;DEPS" ${ARGN})
  add_library(ms_${name} STATIC ${M_SOURCES})
  target_include_directories(ms_${name} PUBLIC ${PROJECT_SOURCE_DIR}/lib)
  target_link_libraries(ms_${name} PUBLIC ${M_DEPS})
endfunction()

# ms_test_code(TARGET ...): compiles the targets' own C++ sources (test code: doctest cases, test helpers) at -O1 in
# optimized builds. The code under test is in the libraries they link (lib/, kernels/), which keep the build type's
# flags; test sources at -O3 took ~45 % longer to compile (384 against 263 s of CPU per Release build, a minute of a
# 2-core CI run) and ran no faster. Debug (the sanitizer build) is left at -O0. Benchmarks (bench/) are not test code.
function(ms_test_code)
  foreach(target ${ARGN})
    target_compile_options(${target} PRIVATE $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<NOT:$<CONFIG:Debug>>>:-O1>)
  endforeach()
endfunction()

# ms_test(NAME SOURCES ... DEPS ... [LABELS ...]): one doctest executable, registered with ctest.
function(ms_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(test_${name} ${T_SOURCES})
  ms_test_code(test_${name})
  target_link_libraries(test_${name} PRIVATE ${T_DEPS} ms_doctest_main doctest::doctest)
  target_include_directories(test_${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_definitions(test_${name} PRIVATE MS_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
                                                  MS_BINARY_DIR="${PROJECT_BINARY_DIR}")
  add_test(NAME ${name} COMMAND test_${name})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS};cpu")
endfunction()

# ms_test_cost(NAME SECONDS [NAME SECONDS ...]): the longest tests first. A fresh clone has no ctest timing history,
# and in declaration order the Slurm test (~2 minutes on CI's 2 cores) started among the last, alone at the end of
# the run; COST (about a test's seconds there) makes ctest start the long ones first. Call it in the directory
# that adds the tests (set_tests_properties sees only those); a name not defined in this build is skipped.
function(ms_test_cost)
  set(args ${ARGN})
  while(args)
    list(POP_FRONT args name cost)
    if(TEST ${name})
      set_tests_properties(${name} PROPERTIES COST ${cost})
    endif()
  endwhile()
endfunction()
