# ms_module(NAME SOURCES ... DEPS ...): one static library per lib/<NAME>/ folder.
function(ms_module name)
  cmake_parse_arguments(M "" "" "SOURCES;DEPS" ${ARGN})
  add_library(ms_${name} STATIC ${M_SOURCES})
  target_include_directories(ms_${name} PUBLIC ${PROJECT_SOURCE_DIR}/lib)
  target_link_libraries(ms_${name} PUBLIC ${M_DEPS})
endfunction()

# ms_test(NAME SOURCES ... DEPS ... [LABELS ...]): one doctest executable, registered with ctest.
function(ms_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(test_${name} ${T_SOURCES})
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
