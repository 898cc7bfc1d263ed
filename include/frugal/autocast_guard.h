// Autocast as an RAII guard: the mechanism below the policies (AutocastPolicy, checkpoints).
#pragma once

#include <torch/types.h>

namespace frugal {

/// Runs eligible ops in a lower precision (bf16 or fp16) for its lifetime, on one device
/// type. Nested guards restore the outer state (enabled flag and dtype) on exit, and the
/// autocast cache of weight casts is cleared only when the outermost region exits.
/// Throws when the device type cannot autocast to `dtype` with this LibTorch (fp16 on the
/// CPU needs LibTorch 2.4 or later).
///
/// Example:
///   {
///     frugal::AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
///     auto y = model->forward(x);  // matmuls in bf16
///   }
class AutocastGuard {
 public:
  AutocastGuard(torch::DeviceType device_type, torch::Dtype dtype, bool enabled = true);
  /// Throws, naming both, when this LibTorch cannot autocast `device_type` to `dtype`.
  static void check_supported(torch::DeviceType device_type, torch::Dtype dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  torch::DeviceType type_;
  bool previous_enabled_;
  torch::Dtype previous_dtype_;
};

}  // namespace frugal
