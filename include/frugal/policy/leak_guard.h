// Catches memory that grows from step to step: a kept loss tensor, a growing history.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "frugal/train/policy.h"

namespace frugal {

/// Thrown by LeakGuard when allocated bytes after a step exceed the baseline.
class LeakError : public std::runtime_error {
 public:
  LeakError(const std::string& what, std::int64_t growth)
      : std::runtime_error(what), growth_(growth) {}
  std::int64_t growth() const { return growth_; }

 private:
  std::int64_t growth_;
};

struct LeakGuardOptions {
  /// Optimizer steps before the baseline is taken (optimizer state appears lazily).
  TORCH_ARG(std::int64_t, warmup) = 2;
  /// Growth in bytes that is still accepted.
  TORCH_ARG(std::int64_t, tolerance) = 0;
  /// Throw LeakError on growth; otherwise only record it (see `growth()`).
  TORCH_ARG(bool, throw_on_leak) = true;
};

/// After `warmup` optimizer steps, the allocated bytes after each optimizer step must come
/// back to the baseline (the figure after the first step past the warm-up). A step that
/// leaves more behind is reported with the size of the growth.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::LeakGuard>());
class LeakGuard : public Policy {
 public:
  explicit LeakGuard(LeakGuardOptions options = {});
  std::string name() const override { return "leak-guard"; }
  void on_step_end(StepContext& ctx) override;

  /// Baseline in bytes, or -1 while warming up.
  std::int64_t baseline() const { return baseline_; }
  /// Largest growth over the baseline seen so far.
  std::int64_t growth() const { return growth_; }

 private:
  LeakGuardOptions options_;
  std::int64_t seen_ = 0;
  std::int64_t baseline_ = -1;
  std::int64_t growth_ = 0;
};

}  // namespace frugal
