// The trainer's policies, hooks and sinks, and the gradient-ready calls that reach policies.
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <string>
#include <unordered_map>

#include "../engine/compatibility.h"
#include "../engine/grad_ready.h"
#include "../engine/partial_step.h"
#include "../memory/module_tensors.h"
#include "frugal/error.h"
#include "frugal/optim/sharded.h"
#include "frugal/train/trainer.h"
#include "parts.h"

namespace frugal {

Trainer& Trainer::add_policy(std::shared_ptr<Policy> policy) {
  FRUGAL_CHECK(policy != nullptr, "frugal: add_policy got a null policy");
  // The traits are read once, here, and checked against the optimizer's and every earlier
  // policy's in the one table of refused pairs.
  const Traits traits = policy->traits();
  std::vector<detail::Party> present;
  present.push_back({"the optimizer", optimizer_traits_});
  for (std::size_t i = 0; i < policies_.size(); ++i) {
    present.push_back({fmt::format("'{}'", policies_[i]->name()), policy_traits_[i]});
  }
  detail::check_compatible(present, {fmt::format("'{}'", policy->name()), traits});
  policy->on_add(*this);
  if (traits.has(Trait::GradReady)) {
    if (!parts_->grad_ready) {
      parts_->grad_ready = std::make_unique<detail::GradReady>(
          optimizer_, [this](const torch::Tensor& param) { grad_ready(param); });
    }
    grad_ready_policies_.push_back(policy.get());
  }
  if (traits.has(Trait::OwnsNonFinite)) {
    parts_->guard.disable();  // the policy decides what a NaN or inf does to the step
  }
  traits_ |= traits;
  policy_traits_.push_back(traits);
  policies_.push_back(std::move(policy));
  parts_->module_tensors->refresh();  // a policy may have rearranged the module tree (on_add)
  return *this;
}

void Trainer::grad_ready(const torch::Tensor& param) {
  TORCH_INTERNAL_ASSERT(backward_ctx_ != nullptr, "gradient-ready call outside a step");
  for (auto* policy : grad_ready_policies_) {
    policy->on_grad_ready(*backward_ctx_, param);
  }
}

void Trainer::set_unscale(Unscale unscale) { unscale_ = std::move(unscale); }

void Trainer::unscale_gradients() {
  if (unscale_) {
    unscale_(optimizer_);
  }
}

PartialStepError Trainer::partial_error(const char* where,
                                        const std::vector<torch::Tensor>& changed,
                                        const std::exception& error) {
  auto partial = detail::partial_step_error(
      *module_, where, changed, error,
      "the others and the trainer's counters are as before; the window's gradients were "
      "dropped and the step was not retried. The trainer refuses further steps until "
      "accept_partial_update() is called (or a saved state loaded)");
  parts_->halt.halt(fmt::format("{} of step {} changed {} parameter(s) before failing", where,
                                steps_ + 1, partial.updated.size()));
  return partial;
}

Trainer& Trainer::add_hook(Phase phase, HookPolicy::Fn fn) {
  FRUGAL_CHECK(fn != nullptr, "frugal: add_hook(", phase_name(phase), ") got an empty function");
  return add_policy(std::make_shared<HookPolicy>(phase, std::move(fn)));
}

Trainer& Trainer::add_sink(std::shared_ptr<ReportSink> sink) {
  FRUGAL_CHECK(sink != nullptr, "frugal: add_sink got a null sink");
  sinks_.push_back(std::move(sink));
  return *this;
}

}  // namespace frugal
