# Finds LibTorch, either through FRUGAL_PYTHON (a python3 whose torch package carries
# LibTorch) or through the usual CMAKE_PREFIX_PATH / system locations, and tells
# whether that LibTorch was built with CUDA (FRUGAL_WITH_CUDA).
function(frugal_find_torch)
  if(FRUGAL_PYTHON)
    execute_process(
      COMMAND "${FRUGAL_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE rc ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "FRUGAL_PYTHON=${FRUGAL_PYTHON} cannot import torch: ${err}")
    endif()
    # The package's own lib/ must win over a LibTorch installed on the system.
    get_filename_component(torch_root "${torch_prefix}/../.." ABSOLUTE)
    list(PREPEND CMAKE_PREFIX_PATH "${torch_prefix}" "${torch_root}")
  endif()
  find_package(Torch REQUIRED)
  set(with_cuda OFF)
  if(TORCH_CUDA_LIBRARIES OR C10_CUDA_LIBRARY)
    set(with_cuda ON)
  endif()
  set(FRUGAL_WITH_CUDA ${with_cuda} PARENT_SCOPE)

  # A pip-installed CUDA LibTorch finds its CUDA libraries (nvidia/*/lib beside it) only
  # because Python preloads them; its libraries carry no RUNPATH. A C++ program must name
  # them itself, before any older copies the system has (a CUDA toolkit's NCCL, say), for
  # the link and at run time. DT_RPATH (not RUNPATH) also covers libtorch_cuda's own needs.
  get_filename_component(torch_root "${Torch_DIR}/../../.." ABSOLUTE)
  file(GLOB wheel_lib_dirs LIST_DIRECTORIES true "${torch_root}/../nvidia/*/lib")
  set(link_options "")
  if(wheel_lib_dirs)
    list(JOIN wheel_lib_dirs ":" joined)
    set(link_options "LINKER:--disable-new-dtags" "LINKER:-rpath,${joined}"
                     "LINKER:-rpath-link,${joined}")
  endif()
  # Some wheels' libtorch.so (2.11.0's) export a copy of libstdc++'s std::filesystem, and
  # the dynamic linker binds a program's calls to the first library in its list that defines
  # them: there std::filesystem::remove_all jumps through a null pointer. Python has loaded
  # libstdc++ before torch; a C++ program names it first for the same order.
  if(FRUGAL_PYTHON)
    list(APPEND link_options "SHELL:-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
  endif()
  set(FRUGAL_TORCH_LINK_OPTIONS "${link_options}" PARENT_SCOPE)
  set(Torch_DIR "${Torch_DIR}" PARENT_SCOPE)
  set(TORCH_LIBRARIES "${TORCH_LIBRARIES}" PARENT_SCOPE)
  set(Torch_VERSION "${Torch_VERSION}" PARENT_SCOPE)
  message(STATUS "frugal: LibTorch ${Torch_VERSION} from ${Torch_DIR}, CUDA: ${with_cuda}")
endfunction()
