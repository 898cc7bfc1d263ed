// A batch's forward and backward passes, one micro-batch after another, and their retries.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "../engine/loss_tally.h"
#include "policy_set.h"
#include "step_state.h"

namespace frugal::detail {

/// Runs the batch in `state.split`: per micro-batch the forward under the policies' forward
/// hooks, the loss weighted by its share of the global count, and the backward (gradient-
/// ready calls armed in the one that completes the optimizer step). A failed attempt drops
/// what it made; the batch runs again, split anew, while a policy asks to retry.
class StepRunner {
 public:
  StepRunner(StepState& state, const PolicySet& policies) : state_(state), policies_(policies) {}

  /// Fills `ctx.report`'s count, loss, micro-batches, peaks and phase times. `isolate`: the
  /// window's earlier gradients wait aside while the batch runs, so a failed attempt cannot
  /// spoil them (a retrying policy needs that), and are added back when it succeeds.
  void run(StepContext& ctx, bool isolate);

 private:
  void run_micro_batches(StepContext& ctx, std::vector<torch::Tensor>* aside);
  torch::Tensor loss_of(const Batch& micro);
  torch::Tensor weigh(torch::Tensor loss, std::int64_t count, std::int64_t total,
                      detail::LossTally& log) const;
  bool skips_last_backward(const StepContext& ctx, detail::LossTally& log);
  void backward(StepContext& ctx, bool completes_step, std::vector<torch::Tensor>* aside,
                double ready_scale);

  StepState& state_;
  const PolicySet& policies_;
};

}  // namespace frugal::detail
