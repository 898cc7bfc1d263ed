# FRUGAL_SANITIZE=address,undefined builds frugal, its tests, examples and benchmarks with
# those sanitizers; the flags reach consumers of the installed package through frugal's
# link options, so a program that links it gets the runtime it needs. LibTorch itself is
# not instrumented: ASan still sees every allocation (it replaces malloc) and frugal's own
# code is checked.
if(FRUGAL_SANITIZE)
  set(FRUGAL_SANITIZE_FLAGS -fsanitize=${FRUGAL_SANITIZE} -fno-sanitize-recover=all
                            -fno-omit-frame-pointer)
  # -g1: line tables only, enough for file:line in the sanitizers' stack traces, and a fifth
  # less compile time than full debug information over LibTorch's headers.
  add_compile_options(${FRUGAL_SANITIZE_FLAGS} -g1)
  add_link_options(-fsanitize=${FRUGAL_SANITIZE})
  message(STATUS "frugal: building with -fsanitize=${FRUGAL_SANITIZE}")
endif()
