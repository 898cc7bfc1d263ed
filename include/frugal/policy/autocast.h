// Autocast as an RAII guard and as a policy of the step engine.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "frugal/train/policy.h"

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
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  torch::DeviceType type_;
  bool previous_enabled_;
  torch::Dtype previous_dtype_;
};

/// Wraps every forward pass of the step in an AutocastGuard. Parameters and their
/// gradients stay in their own dtype (float32); activations are bf16/fp16.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::AutocastPolicy>(torch::kCPU, torch::kBFloat16));
class AutocastPolicy : public Policy {
 public:
  AutocastPolicy(torch::DeviceType device_type, torch::Dtype dtype);
  std::string name() const override;
  void before_forward(StepContext& ctx) override;
  void after_forward(StepContext& ctx) override;

  torch::DeviceType device_type() const { return type_; }
  torch::Dtype dtype() const { return dtype_; }
  /// Turns the policy off (forward in the parameters' precision) or on again.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

 private:
  torch::DeviceType type_;
  torch::Dtype dtype_;
  bool enabled_ = true;
  std::vector<std::unique_ptr<AutocastGuard>> active_;
};

}  // namespace frugal
