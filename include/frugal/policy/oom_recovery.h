// Survives out-of-memory errors inside a step by shrinking the micro-batch, keeping the
// effective batch and the gradient the optimizer sees.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>

#include "frugal/train/policy.h"

namespace frugal {

struct OomRecoveryOptions {
  /// The smallest micro-batch to try; below it the step gives up.
  TORCH_ARG(std::int64_t, min_micro_batch) = 1;
  /// After this many clean steps, try doubling the micro-batch again (0: never).
  TORCH_ARG(std::int64_t, grow_after) = 0;
};

/// On c10::OutOfMemoryError in forward or backward (typed, not matched by message), the
/// engine drops the failed attempt's tensors; this policy empties the allocator's cache,
/// halves the micro-batch and has the same batch run again, so the optimizer step sees the
/// gradient it would have seen without the error. The smaller micro-batch is kept for
/// later steps. At the floor it gives up with an error naming the memory figures; the
/// model and optimizer are then as before the step. In evaluate(), it halves the
/// evaluation batch only.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::OomRecovery>());
class OomRecovery : public Policy {
 public:
  explicit OomRecovery(OomRecoveryOptions options = {});
  std::string name() const override { return "oom-recovery"; }
  bool on_step_error(StepContext& ctx, const std::exception& error) override;
  /// Out of memory in the optimizer step: says what the step held and what would fit.
  void on_optimizer_error(StepContext& ctx, const std::exception& error) override;
  bool on_eval_error(PolicyPort& port, std::int64_t batch_size,
                     const std::exception& error) override;
  Traits traits() const override { return Trait::Retries; }
  void on_step_end(StepContext& ctx) override;
  /// Keeps the micro-batch it started from, its clean-step count and recoveries (the
  /// micro-batch in use is the trainer's, saved with it).
  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_state(torch::serialize::InputArchive& archive) override;

  /// Out-of-memory errors recovered from so far (steps and evaluations).
  std::int64_t recovered() const { return recovered_; }

 private:
  OomRecoveryOptions options_;
  PolicyPort* port_ = nullptr;  // the engine whose micro-batch it grows back
  std::int64_t largest_ = 0;  // the micro-batch before the first shrink
  std::int64_t clean_steps_ = 0;
  std::int64_t recovered_ = 0;
};

}  // namespace frugal
