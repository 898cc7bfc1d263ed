# Strict warnings on frugal's own code; LibTorch and other imported headers are SYSTEM.
function(frugal_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
endfunction()
