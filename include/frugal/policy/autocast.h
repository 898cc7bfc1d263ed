// Autocast as a policy of the step engine: every forward under an AutocastGuard.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

#include "frugal/autocast_guard.h"
#include "frugal/train/policy.h"

namespace frugal {

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
  void on_evaluate_begin(PolicyPort& port) override;
  void on_evaluate_end(PolicyPort& port) override;

  torch::DeviceType device_type() const { return type_; }
  torch::Dtype dtype() const { return dtype_; }
  /// Turns the policy off (forward in the parameters' precision) or on again.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

 private:
  void enter();  // a forward or an evaluation begins: its autocast region
  void leave();
  torch::DeviceType type_;
  torch::Dtype dtype_;
  bool enabled_ = true;
  std::vector<std::unique_ptr<AutocastGuard>> active_;
};

}  // namespace frugal
