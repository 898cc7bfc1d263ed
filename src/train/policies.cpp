// The trainer's policies, hooks and sinks, and the gradient-ready calls that reach policies.
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <string>
#include <unordered_map>

#include "grad_ready.h"
#include "frugal/train/trainer.h"

namespace frugal {

Trainer& Trainer::add_policy(std::shared_ptr<Policy> policy) {
  TORCH_CHECK(policy != nullptr, "frugal: add_policy got a null policy");
  for (const auto& other : policies_) {
    for (const auto& [all, early] : {std::pair{policy.get(), other.get()},
                                     std::pair{other.get(), policy.get()}}) {
      TORCH_CHECK(!(all->needs_all_gradients() && early->updates_in_backward()),
                  "frugal: policy '", all->name(), "' needs every gradient of a step before "
                  "any parameter changes, but '", early->name(), "' updates parameters during "
                  "backward; use one of them");
    }
  }
  policy->on_add(*this);
  if (policy->wants_grad_ready() && !grad_ready_) {
    grad_ready_ = std::make_unique<detail::GradReady>(
        optimizer_, [this](const torch::Tensor& param) { grad_ready(param); });
  }
  policies_.push_back(std::move(policy));
  return *this;
}

void Trainer::grad_ready(const torch::Tensor& param) {
  TORCH_INTERNAL_ASSERT(backward_ctx_ != nullptr, "gradient-ready call outside a step");
  for (auto& policy : policies_) {
    if (policy->wants_grad_ready()) {
      policy->on_grad_ready(*backward_ctx_, param);
    }
  }
}

void Trainer::throw_partial(const StepContext& ctx, const std::exception& error) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : module_->named_parameters()) {
    names[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::vector<std::string> updated;
  for (const auto& p : ctx.updated_in_backward) {
    const auto it = names.find(p.unsafeGetTensorImpl());
    updated.push_back(it != names.end() ? it->second : "(a parameter outside the module)");
  }
  std::string list;
  for (const auto& name : updated) {
    list += (list.empty() ? "" : ", ") + name;
  }
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  throw PartialStepError(
      "frugal: the step failed during backward after " + std::to_string(updated.size()) +
          " parameter(s) had been updated in backward" + (list.empty() ? "" : ": " + list) +
          ". Those and their optimizer state hold the new values, the others the old ones; "
          "the step count is as before and the window's gradients were dropped, so the "
          "step was not retried. The error was: " +
          (c10_error != nullptr ? c10_error->what_without_backtrace() : error.what()),
      std::move(updated));
}

Trainer& Trainer::add_hook(Phase phase, HookPolicy::Fn fn) {
  TORCH_CHECK(fn != nullptr, "frugal: add_hook(", phase_name(phase), ") got an empty function");
  return add_policy(std::make_shared<HookPolicy>(phase, std::move(fn)));
}

Trainer& Trainer::add_sink(std::shared_ptr<ReportSink> sink) {
  TORCH_CHECK(sink != nullptr, "frugal: add_sink got a null sink");
  sinks_.push_back(std::move(sink));
  return *this;
}

}  // namespace frugal
