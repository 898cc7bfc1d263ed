// The optimizer phase of a step: the window's division, the optimizer step under the
// non-finite guard and the step guarantee, and the counting that follows it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "policy_set.h"
#include "step_state.h"

namespace frugal::detail {

/// Ends an accumulation window with one optimizer step. Until the optimizer's step has
/// returned, a failure leaves parameters, optimizer state and counters as they were (the
/// window's gradients, already divided, are dropped), or names the parameters the optimizer
/// had written (PartialStepError) and halts the trainer. From then on the step is counted,
/// whatever the hooks after it do.
class OptimizerPhase {
 public:
  OptimizerPhase(StepState& state, const PolicySet& policies)
      : state_(state), policies_(policies) {}

  /// Divides the window's gradients by `window_count`, steps (or skips a non-finite step),
  /// counts the step (and the batch, `ends_batch`), and zeroes the gradients. The phase's
  /// time runs from the state's last phase boundary into `ctx.report`.
  void run(StepContext& ctx, std::int64_t window_count, bool ends_batch);

 private:
  // `changed`: the parameters the failed optimizer step wrote (the rest were put back).
  [[noreturn]] void failed(StepContext& ctx, const std::vector<torch::Tensor>& changed,
                           const std::exception* error);

  StepState& state_;
  const PolicySet& policies_;
};

}  // namespace frugal::detail
