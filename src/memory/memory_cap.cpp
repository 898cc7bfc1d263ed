#include "frugal/memory/memory_cap.h"

#include <torch/cuda.h>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"

namespace frugal {
namespace {

torch::Device checked_device(torch::Device device, std::int64_t bytes) {
  FRUGAL_CHECK(bytes > 0, "frugal: a memory cap must be > 0 bytes, got ", bytes);
  FRUGAL_CHECK(device.is_cpu() || device.is_cuda(),
               "frugal: a memory cap is for cpu or cuda devices, not ", device.str());
  if (device.is_cpu()) {
    return torch::kCPU;
  }
#ifdef FRUGAL_WITH_CUDA
  FRUGAL_CHECK(torch::cuda::is_available(), "frugal: a memory cap on ", device.str(),
               ": CUDA is not available here");
  const c10::DeviceIndex index = device.has_index() ? device.index() : 0;
  FRUGAL_CHECK(index < static_cast<int>(torch::cuda::device_count()), "frugal: a memory cap on ",
               device.str(), ": there are only ", torch::cuda::device_count(), " CUDA devices");
  return {torch::kCUDA, index};
#else
  FRUGAL_CHECK(false, "frugal: a memory cap on ", device.str(),
               ": this frugal was built against a LibTorch without CUDA");
  return device;
#endif
}

}  // namespace

ScopedMemoryCap::ScopedMemoryCap(torch::Device device, std::int64_t bytes)
    : device_(checked_device(device, bytes)), bytes_(bytes) {
  if (device_.is_cpu()) {
    previous_cap_ = CountingAllocator::cap();
    CountingAllocator::install();
    CountingAllocator::set_cap(bytes_);
    return;
  }
#ifdef FRUGAL_WITH_CUDA
  const auto total = compat::cuda_total_memory(device_.index());
  FRUGAL_CHECK(bytes_ <= total, "frugal: a memory cap of ", format_bytes(bytes_), " (", bytes_,
               " bytes) on ", device_.str(), " is more than its ", format_bytes(total));
  previous_fraction_ = compat::cuda_memory_fraction(device_.index());
  compat::cuda_set_memory_fraction(static_cast<double>(bytes_) / static_cast<double>(total),
                                   device_.index());
#endif
}

ScopedMemoryCap::~ScopedMemoryCap() {
  if (device_.is_cpu()) {
    CountingAllocator::set_cap(previous_cap_);
    return;
  }
#ifdef FRUGAL_WITH_CUDA
  compat::cuda_set_memory_fraction(previous_fraction_, device_.index());
#endif
}

}  // namespace frugal
