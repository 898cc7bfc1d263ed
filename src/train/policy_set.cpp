#include "policy_set.h"

#include <fmt/format.h>

#include <algorithm>

#include "../engine/compatibility.h"
#include "frugal/error.h"

namespace frugal::detail {

Traits PolicySet::add(std::shared_ptr<Policy> policy, PolicyPort& port) {
  FRUGAL_CHECK(policy != nullptr, "frugal: add_policy got a null policy");
  // The traits are read once, here, and checked against the optimizer's and every earlier
  // policy's in the one table of refused pairs.
  const Traits traits = policy->traits();
  std::vector<Party> present;
  present.push_back({"the optimizer", optimizer_traits_});
  for (std::size_t i = 0; i < policies_.size(); ++i) {
    present.push_back({fmt::format("'{}'", policies_[i]->name()), policy_traits_[i]});
  }
  check_compatible(present, {fmt::format("'{}'", policy->name()), traits});
  policy->on_add(port);
  if (traits.has(Trait::GradReady)) {
    grad_ready_.push_back(policy.get());
  }
  traits_ |= traits;
  policy_traits_.push_back(traits);
  policies_.push_back(std::move(policy));
  return traits;
}

void PolicySet::run(void (Policy::*hook)(StepContext&), StepContext& ctx) const {
  for (const auto& policy : policies_) {
    ((*policy).*hook)(ctx);
  }
}

bool PolicySet::retry(StepContext& ctx, const std::exception& error) const {
  return std::any_of(policies_.begin(), policies_.end(),
                     [&](const auto& policy) { return policy->on_step_error(ctx, error); });
}

void PolicySet::optimizer_failed(StepContext& ctx, const std::exception& error,
                                 bool quietly) const {
  for (const auto& policy : policies_) {
    if (!quietly) {
      policy->on_optimizer_error(ctx, error);  // may raise a clearer error instead
      continue;
    }
    try {
      policy->on_optimizer_error(ctx, error);
    } catch (...) {
      // `error` is what the caller must hear of.
    }
  }
}

void PolicySet::grad_ready(StepContext& ctx, const torch::Tensor& param) const {
  for (auto* policy : grad_ready_) {
    policy->on_grad_ready(ctx, param);
  }
}

PolicySet::Evaluation::Evaluation(const PolicySet& set, PolicyPort& port) : set_(set), port_(port) {
  try {
    for (; begun_ < set_.policies_.size(); ++begun_) {
      set_.policies_[begun_]->on_evaluate_begin(port_);
    }
  } catch (...) {
    end();  // those begun end as if the evaluation had
    throw;
  }
}

PolicySet::Evaluation::~Evaluation() { end(); }

void PolicySet::Evaluation::end() {
  while (begun_ > 0) {
    set_.policies_[--begun_]->on_evaluate_end(port_);
  }
}

bool PolicySet::eval_retry(PolicyPort& port, std::int64_t batch_size,
                           const std::exception& error) const {
  return std::any_of(policies_.begin(), policies_.end(), [&](const auto& policy) {
    return policy->on_eval_error(port, batch_size, error);
  });
}

}  // namespace frugal::detail
