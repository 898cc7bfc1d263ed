# Strict warnings on frugal's own code; LibTorch and other imported headers are SYSTEM.
# FRUGAL_WERROR=OFF keeps the warnings but not as errors: for a one-off build with a compiler
# frugal is not checked against (a GPU host's), where a new warning must not stop the check.
option(FRUGAL_WERROR "Treat warnings in frugal's code as errors" ON)
function(frugal_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(FRUGAL_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

# A program of a family (the examples, the benchmarks) with LibTorch's, fmt's and CLI11's
# headers precompiled once for the family: the first, `first` empty, compiles them, and the
# others reuse its header (the same flags, so GCC accepts it).
function(frugal_program_pch target first)
  if(first)
    target_precompile_headers(${target} REUSE_FROM ${first})
  else()
    target_precompile_headers(${target} PRIVATE <torch/torch.h> <fmt/format.h> <CLI/CLI.hpp>)
  endif()
endfunction()
