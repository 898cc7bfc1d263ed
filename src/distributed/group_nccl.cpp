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
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#if FRUGAL_TORCH_AT_LEAST(2, 4)
  // The group's one device, as init_process_group(device_id=...) binds it: NCCL then makes
  // its communicator for that device alone, never guessing one from the rank (a barrier
  // before any collective would).
  group->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
#endif
  return group;
}

}  // namespace frugal::distributed::detail
