# Script mode (cmake -P), after each build of a googletest executable: writes OUTPUT, CTest's tests for its suites
# (cmake/GTestSuites.cmake). Inputs: EXECUTABLE, OUTPUT, EXCLUDE (a regular expression on suite names, or empty),
# LABELS (a list), WORKING_DIRECTORY.
execute_process(COMMAND "${EXECUTABLE}" --gtest_list_tests OUTPUT_VARIABLE listed ERROR_VARIABLE errors
                RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "listing the tests of ${EXECUTABLE} failed (${rc}):\n${listed}\n${errors}")
endif()
string(REPLACE ";" "\\;" listed "${listed}")
string(REPLACE "\n" ";" lines "${listed}")
set(suites "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([A-Za-z_][A-Za-z0-9_/]*)\\.( |$)")  # "Suite." or "Prefix/Suite." (then "  # TypeParam = ...")
    set(suite "${CMAKE_MATCH_1}")
    if(EXCLUDE STREQUAL "" OR NOT suite MATCHES "${EXCLUDE}")
      list(APPEND suites "${suite}")
    endif()
  endif()
endforeach()
if(NOT suites)
  message(FATAL_ERROR "no googletest suites listed by ${EXECUTABLE}:\n${listed}")
endif()
set(script "# Written by cmake/gtest_suites_list.cmake from ${EXECUTABLE} --gtest_list_tests\n")
foreach(suite IN LISTS suites)
  string(APPEND script "add_test([==[${suite}]==] [==[${EXECUTABLE}]==] [==[--gtest_filter=${suite}.*]==])\n"
         "set_tests_properties([==[${suite}]==] PROPERTIES LABELS [==[${LABELS}]==] "
         "WORKING_DIRECTORY [==[${WORKING_DIRECTORY}]==])\n")
endforeach()
file(WRITE "${OUTPUT}" "${script}")
