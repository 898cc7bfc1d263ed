// Gradient clipping before the optimizer step, on true (unscaled) gradients.
#pragma once

#include <torch/arg.h>

#include <memory>
#include <string>

#include "frugal/train/policy.h"

namespace frugal {

struct ClipGradOptions {
  /// Clip the global norm of all gradients to this (0: off).
  TORCH_ARG(double, max_norm) = 0.0;
  /// The norm's type (2 for Euclidean, inf for max).
  TORCH_ARG(double, norm_type) = 2.0;
  /// Clamp every gradient value to [-max_value, max_value] (0: off).
  TORCH_ARG(double, max_value) = 0.0;
};

/// Clips gradients before the optimizer step. Gradients that carry a loss scale (a
/// GradScalerPolicy's) are unscaled first, through the port, so the thresholds apply to the
/// true gradients, whatever order the policies were added in.
/// The last norm (before clipping) is kept in `last_norm()`.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::ClipGrad>(
///       frugal::ClipGradOptions().max_norm(1.0)));
class ClipGrad : public Policy {
 public:
  explicit ClipGrad(ClipGradOptions options);
  std::string name() const override { return "clip-grad"; }
  /// Acts on every gradient before any parameter changes.
  Traits traits() const override { return Trait::AllGradients; }
  void before_optimizer_step(StepContext& ctx) override;
  double last_norm() const { return last_norm_; }

 private:
  ClipGradOptions options_;
  double last_norm_ = 0.0;
};

}  // namespace frugal
