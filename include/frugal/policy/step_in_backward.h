// The optimizer step fused into backward: each parameter is updated, and its gradient
// freed, as soon as that gradient is final, so the whole set of gradients never exists.
#pragma once

#include <string>

#include "frugal/optim/in_place.h"
#include "frugal/train/policy.h"

namespace frugal {

/// Updates each parameter during the backward that completes an optimizer step (the last
/// micro-batch of the window's last batch), from the engine's gradient-ready calls, and
/// frees its gradient at once (LOMO, "optimizer step in backward"). At most one parameter's
/// gradient is alive at a time, where a plain step holds all of them at the end of backward.
/// The result equals the ordinary step's: each parameter sees the same gradient and the same
/// update; parameters whose gradient came only from earlier micro-batches are stepped in the
/// optimizer phase as usual.
///
/// Needs one of frugal's optimizers (frugal::optim::SGD, Adam, AdamW), which update one
/// parameter at a time; refused with an error at add_policy otherwise (LBFGS needs all
/// gradients and a closure). Refused beside policies that need every gradient before any
/// update: GradScaler (its inf/NaN check; mixed precision with float16), clipping
/// (ClipGrad). bfloat16 autocast, checkpointing, micro-batches and accumulation work.
///
/// If backward fails after the first parameter was updated, the step cannot be retried or
/// undone: the engine raises PartialStepError naming the updated parameters; OomRecovery
/// retries only failures that come before (forward, or backward before the first update).
///
/// Example:
///   frugal::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
///   frugal::Trainer trainer(model, adam, loss_fn);
///   trainer.add_policy(std::make_shared<frugal::StepInBackward>());
class StepInBackward : public Policy {
 public:
  std::string name() const override { return "step-in-backward"; }
  /// Gradient-ready calls, in which it changes parameters.
  Traits traits() const override { return Trait::GradReady | Trait::UpdatesInBackward; }
  void on_add(PolicyPort& port) override;
  void on_grad_ready(StepContext& ctx, const torch::Tensor& param) override;

  /// Off, the policy does nothing (the planner switches it).
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

 private:
  optim::InPlaceOptimizer* optimizer_ = nullptr;
  bool enabled_ = true;
};

}  // namespace frugal
