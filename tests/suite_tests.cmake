# Read by CTest before it runs (a TEST_INCLUDE_FILES entry written by tests/CMakeLists.txt):
# one test for each GoogleTest suite of the test executable, run as one process with a filter
# of that suite. A process a test spent most of a short test's time loading LibTorch (0.5 s,
# 1.5 s under the sanitizers); a suite's tests share one.
#
# Set by the includer:
#   frugal_exe          the test executable
#   frugal_rank_suites  the suites that start ranks: label `ranks`, run alone (RUN_SERIAL)
#   frugal_timeout      each suite's time limit, in seconds
# Suites whose name (or parameterised name, Prefix/Name) starts with Cuda are labelled `gpu`;
# the rest `cpu`. A suite whose every test skipped itself (no GPU, say) is reported skipped.

if(NOT EXISTS "${frugal_exe}")
  add_test(frugal_tests_NOT_BUILT "${frugal_exe}")
  return()
endif()
execute_process(COMMAND "${frugal_exe}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE listing_error RESULT_VARIABLE listed
                TIMEOUT 120)
if(NOT listed EQUAL 0)
  message(FATAL_ERROR "${frugal_exe} --gtest_list_tests failed (${listed}): ${listing_error}")
endif()

string(REPLACE "\n" ";" lines "${listing}")
foreach(line IN LISTS lines)
  # A suite's line starts in the first column: "Name." or "Prefix/Name.  # TypeParam = ...".
  if(NOT line MATCHES "^([A-Za-z0-9_/]+)\\.")
    continue()
  endif()
  set(suite "${CMAKE_MATCH_1}")
  string(REGEX REPLACE "^.*/" "" bare "${suite}")
  list(FIND frugal_rank_suites "${bare}" rank_index)
  add_test("${suite}" "${frugal_exe}" "--gtest_filter=${suite}.*")
  set_tests_properties("${suite}" PROPERTIES TIMEOUT "${frugal_timeout}"
                       SKIP_REGULAR_EXPRESSION "\\[  PASSED  \\] 0 tests\\.")
  if(bare MATCHES "^Cuda")
    set_tests_properties("${suite}" PROPERTIES LABELS gpu)
  elseif(NOT rank_index EQUAL -1)
    set_tests_properties("${suite}" PROPERTIES LABELS ranks RUN_SERIAL TRUE)
  else()
    set_tests_properties("${suite}" PROPERTIES LABELS cpu)
  endif()
endforeach()
