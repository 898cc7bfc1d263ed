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
