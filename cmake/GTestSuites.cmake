# dkfac_gtest_suites(TARGET [EXCLUDE REGEX] [FILTER_OUT PATTERN] [TIMEOUT SECONDS] [LABELS LABEL...]): one CTest
# test per googletest suite of TARGET, in place of gtest_discover_tests' one per test. Each test process loads
# LibTorch first (about half a second of a core here), and the suites hold 5 tests each on average, so the default
# suite spends a fifth of that time. A failure still names its test: googletest prints each test's result, and the
# CTest test is named after its suite. Suites whose name matches EXCLUDE are left out (those of another label,
# discovered per test elsewhere), and so are the tests matching the googletest pattern FILTER_OUT in the suites
# kept; suites named DISABLED_* are left out as googletest leaves them. The list is read from the built executable
# after each build (tests/<TARGET>_suites.cmake), as gtest_discover_tests does; a listing that fails fails the
# build.
function(dkfac_gtest_suites target)
  cmake_parse_arguments(ARG "" "EXCLUDE;FILTER_OUT;TIMEOUT" "LABELS" ${ARGN})
  set(suites_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_include.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -DEXECUTABLE=$<TARGET_FILE:${target}> -DOUTPUT=${suites_file}
            "-DEXCLUDE=${ARG_EXCLUDE}" "-DFILTER_OUT=${ARG_FILTER_OUT}" "-DTIMEOUT=${ARG_TIMEOUT}"
            "-DLABELS=${ARG_LABELS}" -DWORKING_DIRECTORY=${CMAKE_CURRENT_BINARY_DIR}
            -P ${PROJECT_SOURCE_DIR}/cmake/gtest_suites_list.cmake
    BYPRODUCTS ${suites_file} VERBATIM)
  file(WRITE "${include_file}"
       "if(EXISTS \"${suites_file}\")\n  include(\"${suites_file}\")\nelse()\n"
       "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\n"
       "  set_tests_properties(${target}_NOT_BUILT PROPERTIES LABELS \"${ARG_LABELS}\")\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
