// The leak check as a Trainer policy.
#pragma once

#include <string>

#include "frugal/memory/leak_check.h"
#include "frugal/train/policy.h"

namespace frugal {

/// After `warmup` optimizer steps, the allocated bytes after each optimizer step must come
/// back to the baseline (the figure after the first step past the warm-up). A step that
/// leaves more behind is reported with the size of the growth (LeakCheck).
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::LeakGuard>());
class LeakGuard : public Policy {
 public:
  explicit LeakGuard(LeakGuardOptions options = {}) : check_(options) {}
  std::string name() const override { return "leak-guard"; }
  void on_step_end(StepContext& ctx) override;

  /// Baseline in bytes, or -1 while warming up.
  std::int64_t baseline() const { return check_.baseline(); }
  /// Largest growth over the baseline seen so far.
  std::int64_t growth() const { return check_.growth(); }

 private:
  LeakCheck check_;
};

}  // namespace frugal
