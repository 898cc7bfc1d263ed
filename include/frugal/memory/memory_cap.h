// A cap on one device's tensor bytes for a scope: how a smaller card is tried on a larger one.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace frugal {

/// Caps the bytes `device` may hand to tensors while the object lives and puts the earlier
/// cap back when it goes, an exception included. Allocations past the cap fail with
/// c10::OutOfMemoryError, which OomRecovery answers by shrinking the micro-batch.
///
/// CPU: frugal's counting allocator refuses what would take its allocated bytes past `bytes`
/// (as ScopedCpuCap). CUDA: the caching allocator's memory fraction becomes `bytes` over the
/// device's total memory; the fraction bounds the bytes the allocator reserves, rounding and
/// cached blocks included. CUDA is initialised first, so a cap may come before any tensor.
/// What the caching allocator does not hand out stays outside the cap: the CUDA context
/// (hundreds of MiB), cuBLAS/cuDNN workspaces made outside the allocator and NCCL's buffers;
/// a card of `bytes` needs room for those as well.
///
/// Example:
///   frugal::ScopedMemoryCap cap(torch::Device("cuda:0"), frugal::GiB(8));  // an 8 GiB card
class ScopedMemoryCap {
 public:
  /// Throws, naming the value, for `bytes` <= 0, a device other than cpu and cuda, a CUDA
  /// device this process has not, or more bytes than the CUDA device holds.
  ScopedMemoryCap(torch::Device device, std::int64_t bytes);
  ~ScopedMemoryCap();
  ScopedMemoryCap(const ScopedMemoryCap&) = delete;
  ScopedMemoryCap& operator=(const ScopedMemoryCap&) = delete;

  torch::Device device() const { return device_; }
  std::int64_t bytes() const { return bytes_; }

 private:
  torch::Device device_;
  std::int64_t bytes_;
  std::int64_t previous_cap_ = 0;   // CPU
  double previous_fraction_ = 1.0;  // CUDA
};

}  // namespace frugal
