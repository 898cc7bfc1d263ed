// Runs the policies' forward hooks around a forward pass, like a guard.
#pragma once

#include <exception>
#include <memory>
#include <vector>

#include "frugal/train/policy.h"

namespace frugal::detail {

// Calls the policies' forward-exit hooks in reverse order when the forward ends, also
// by an exception, so that policies can pair before/after like a guard.
class ForwardScope {
 public:
  ForwardScope(const std::vector<std::shared_ptr<Policy>>& policies, StepContext& ctx)
      : policies_(policies), ctx_(ctx) {
    for (; entered_ < policies_.size(); ++entered_) {
      policies_[entered_]->before_forward(ctx_);
    }
  }
  ~ForwardScope() noexcept(false) {
    const bool unwinding = std::uncaught_exceptions() > 0;
    while (entered_ > 0) {
      auto& policy = policies_[--entered_];
      if (unwinding) {
        try {
          policy->after_forward(ctx_);
        } catch (...) {
        }
      } else {
        policy->after_forward(ctx_);
      }
    }
  }

 private:
  const std::vector<std::shared_ptr<Policy>>& policies_;
  StepContext& ctx_;
  std::size_t entered_ = 0;
};

}  // namespace frugal::detail
