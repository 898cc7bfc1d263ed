# Installs frugal from BUILD_DIR into a fresh prefix, then configures, builds and runs the
# consumer project against it. Run by CTest as `cmake -P`.
foreach(var BUILD_DIR SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "install_consumer.cmake needs -D${var}=...")
  endif()
endforeach()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()

run("${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}")
string(REPLACE "|" ";" extra "${EXTRA_PREFIXES}")
set(prefixes "${prefix};${extra}")
string(REPLACE "|" ";" launcher "${LAUNCHER}")
run("${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${prefixes}" "-DZLIB_ROOT=${ZLIB_ROOT}"
    "-DCMAKE_CXX_COMPILER_LAUNCHER=${launcher}")
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/consumer")
run("${WORK_DIR}/build/consumer_net")
