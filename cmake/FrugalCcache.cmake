# Compiles through ccache (Debian's `ccache`) where it is installed, with one cache a build
# kind kept outside the repository: a fresh clone of a commit that was built before on the
# same machine compiles from the cache instead of from nothing.
#
#   FRUGAL_CCACHE=OFF            compile directly
#   FRUGAL_CCACHE_DIR=PATH       the cache (default: $XDG_CACHE_HOME or ~/.cache, then
#                                frugal/ccache/<the build folder's name>, so the two LibTorch
#                                builds and the sanitizer build each have their own)
#   FRUGAL_CCACHE_SIZE=SIZE      its bound (default 4G; ccache drops the oldest results past it)
#
# The bound: ccache keeps it for each of its 16 parts (a 16th each), and a precompiled
# LibTorch header is 100-125 MB compressed; at 2G (128 MB a part) storing one cleaned its
# part down to nothing, the header itself included, so every source using it missed.
#
# What makes a clone in another folder hit the cache:
# - base_dir is the source tree, so ccache hashes the paths under it relative to the build
#   folder (build/<preset> in every clone), in command lines and in preprocessed output;
# - __FILE__ (in LibTorch's checks) and the sanitizer build's line tables name files relative
#   to the source tree (-ffile-prefix-map), and the current folder is not hashed (hash_dir);
# - the precompiled headers: ccache may reuse a result compiled with one only when the
#   header's defines and time macros are left out of the hash (sloppiness pch_defines,
#   time_macros), and GCC must record the header it used (-fpch-preprocess).
# CMake's unity sources include their parts by absolute path: they miss ccache's direct mode
# and are matched after preprocessing, a few seconds each instead of a compilation.
option(FRUGAL_CCACHE "Compile through ccache when it is installed" ON)
set(FRUGAL_CCACHE_SIZE "4G" CACHE STRING "The bound of this build's compiler cache")

function(frugal_use_ccache)
  if(NOT FRUGAL_CCACHE OR CMAKE_CXX_COMPILER_LAUNCHER)
    return()
  endif()
  find_program(FRUGAL_CCACHE_PROGRAM ccache)
  if(NOT FRUGAL_CCACHE_PROGRAM)
    message(STATUS "frugal: ccache not found; compiling without a cache")
    return()
  endif()
  if(DEFINED ENV{XDG_CACHE_HOME})
    set(cache_home "$ENV{XDG_CACHE_HOME}")
  else()
    set(cache_home "$ENV{HOME}/.cache")
  endif()
  get_filename_component(build_name "${PROJECT_BINARY_DIR}" NAME)
  set(FRUGAL_CCACHE_DIR "${cache_home}/frugal/ccache/${build_name}" CACHE PATH
      "The compiler cache of this build (one a build kind)")
  set(CMAKE_CXX_COMPILER_LAUNCHER
      /usr/bin/env
      "CCACHE_DIR=${FRUGAL_CCACHE_DIR}"
      "CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}"
      "CCACHE_MAXSIZE=${FRUGAL_CCACHE_SIZE}"
      CCACHE_NOHASHDIR=1
      "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
      CCACHE_COMPRESS=1
      ${FRUGAL_CCACHE_PROGRAM}
      PARENT_SCOPE)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    add_compile_options(-ffile-prefix-map=${PROJECT_SOURCE_DIR}=. -fpch-preprocess)
  endif()
  message(STATUS "frugal: compiling through ccache, cache in ${FRUGAL_CCACHE_DIR}")
endfunction()
