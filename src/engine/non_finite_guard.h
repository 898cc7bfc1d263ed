// The engine's guard against NaN and inf: whether an optimizer step must be skipped.
#pragma once

#include <torch/optim/optimizer.h>

namespace frugal::detail {

/// Decides, before the optimizer step, whether it must be skipped so that a NaN or an
/// infinity cannot reach the weights: when the window's loss was not finite, or (with
/// `check_gradients`) when a gradient is not. Off (`enabled` false, or a policy owns the
/// decision: Trait::OwnsNonFinite) it never skips.
class NonFiniteGuard {
 public:
  NonFiniteGuard(bool enabled, bool check_gradients)
      : enabled_(enabled), check_gradients_(check_gradients) {}

  bool enabled() const { return enabled_; }
  /// Hands the decision to a policy that owns it.
  void disable() { enabled_ = false; }
  /// Whether the step must be skipped, given whether the window's loss was finite (as the
  /// processes agreed, under data parallelism).
  bool skips(bool loss_non_finite, const torch::optim::Optimizer& optimizer) const;

 private:
  bool enabled_;
  bool check_gradients_;
};

/// Whether every gradient of `optimizer`'s parameters is finite (one read of one flag).
bool gradients_finite(const torch::optim::Optimizer& optimizer);

}  // namespace frugal::detail
