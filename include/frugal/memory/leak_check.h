// Catches memory that grows from step to step: a kept loss tensor, a growing history.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace frugal {

/// Thrown by LeakGuard (and a Loop with a leak guard) when allocated bytes after a step
/// exceed the baseline.
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

/// After `warmup` steps, the allocated bytes after each step must come back to the baseline
/// (the figure after the first step past the warm-up); a step that leaves more behind is
/// reported with the size of the growth. What LeakGuard and LoopOptions::leak_guard run.
///
/// Example:
///   frugal::LeakCheck check(frugal::LeakGuardOptions().warmup(1));
///   check.observe(probe.snapshot().allocated, step);  // after every step
class LeakCheck {
 public:
  explicit LeakCheck(LeakGuardOptions options = {});
  /// The allocated bytes after step number `step` (for the message); throws LeakError on
  /// growth above the tolerance when the options say so.
  void observe(std::int64_t allocated, std::int64_t step);

  /// Baseline in bytes, or -1 while warming up.
  std::int64_t baseline() const { return baseline_; }
  /// Largest growth over the baseline seen so far.
  std::int64_t growth() const { return growth_; }
  const LeakGuardOptions& options() const { return options_; }

 private:
  LeakGuardOptions options_;
  std::int64_t seen_ = 0;
  std::int64_t baseline_ = -1;
  std::int64_t growth_ = 0;
};

}  // namespace frugal
