// The NCCL backend (CUDA builds of LibTorch 2.x that ship nccl.h).
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "backend.h"

namespace frugal::distributed::detail {

c10::intrusive_ptr<BackendBase> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                          int size, int device, std::chrono::milliseconds timeout) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace frugal::distributed::detail
