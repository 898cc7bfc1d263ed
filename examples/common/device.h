// The device an example's --device flag names.
#pragma once

#include <fmt/format.h>
#include <torch/torch.h>

#include <stdexcept>
#include <string>

namespace examples {

/// "cpu", "cuda" or "cuda:N". A launcher's rank (`local_rank` >= 0) given plain "cuda" takes
/// GPU LOCAL_RANK, one a rank, as torchrun's programs do with set_device(local_rank).
/// Throws naming the flag's value where CUDA is missing or there is no such GPU.
inline torch::Device pick_device(const std::string& flag, int local_rank = -1) {
  torch::Device device(torch::kCPU);
  try {
    device = torch::Device(flag);
  } catch (const c10::Error&) {
    throw std::invalid_argument(
        fmt::format("--device {}: not a device (cpu, cuda or cuda:N)", flag));
  }
  if (device.is_cpu()) {
    return device;
  }
  if (!device.is_cuda()) {
    throw std::invalid_argument(fmt::format("--device {}: only cpu and cuda are supported", flag));
  }
  if (!torch::cuda::is_available()) {
    throw std::invalid_argument(
        fmt::format("--device {}: CUDA is not available on this machine", flag));
  }
  const auto count = static_cast<int>(torch::cuda::device_count());
  const int index = device.has_index() ? device.index() : (local_rank >= 0 ? local_rank : 0);
  if (index >= count) {
    throw std::invalid_argument(fmt::format("--device {}: {} GPU {} of {} on this machine", flag,
                                            device.has_index() ? "no" : "LOCAL_RANK's", index,
                                            count));
  }
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(index)};
}

}  // namespace examples
