// The optimizer phase of a step: dividing the window's gradients, the optimizer step under
// the step guarantee (undone, or named and halting), and the counting that follows it.
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/torch.h>

#include <algorithm>

#include "grad_ready.h"
#include "internal.h"
#include "step_guard.h"
#include "frugal/train/trainer.h"
#include "frugal/error.h"

namespace frugal {

using detail::Clock;
using detail::ms_since;

void Trainer::optimizer_phase(StepContext& ctx, std::int64_t window_count, bool ends_batch) {
  const auto t = Clock::now();
  ctx.skip_optimizer_step = false;
  ctx.window_count = window_count;
  {
    // Until the optimizer step has returned, a failure leaves parameters, optimizer state
    // and counters as they were (the window's gradients, already divided, are dropped),
    // or says which parameters the optimizer had written before it failed.
    detail::OptimizerStepGuard guard(optimizer_);
    try {
      if (options_.accumulate() > 1) {
        divide_grads(window_count);
      }
      // Without a GradScaler, a NaN or infinite loss (or gradient) would poison the
      // weights: the step is skipped instead, and said so.
      const bool guard = guards_non_finite();
      ctx.non_finite = guard && window_non_finite_;
      for (auto& policy : policies_) {
        policy->before_optimizer_step(ctx);
      }
      if (guard && !ctx.skip_optimizer_step &&
          (ctx.non_finite || (options_.check_gradients() && !grads_finite()))) {
        ctx.skip_optimizer_step = true;
        ctx.report.non_finite = true;
      }
      if (!ctx.skip_optimizer_step) {
        optimizer_.step();
      }
    } catch (const std::exception& error) {
      optimizer_failed(ctx, guard, &error);
    } catch (...) {
      optimizer_failed(ctx, guard, nullptr);
    }
  }
  // The step is applied: from here on the trainer counts it, whatever a later hook does.
  skipped_ += ctx.skip_optimizer_step ? 1 : 0;
  ++steps_;
  batches_ += ends_batch ? 1 : 0;
  drop_window();
  ctx.report.stepped = true;
  ctx.report.skipped = ctx.skip_optimizer_step;
  for (auto& policy : policies_) {
    policy->after_optimizer_step(ctx);
  }
  zero_grads();
  for (auto& policy : policies_) {
    policy->after_zero_grad(ctx);
  }
  ctx.report.time.optimizer_ms = ms_since(t);
}

void Trainer::divide_grads(std::int64_t window_count) {
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / static_cast<double>(window_count);
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined() && !(grad_ready_ && grad_ready_->delivered(p))) {
        p.mutable_grad().mul_(inv);
      }
    }
  }
}

bool Trainer::guards_non_finite() const {
  return options_.skip_non_finite() && !traits_.has(Trait::OwnsNonFinite);
}

bool Trainer::grads_finite() const {
  // One flag on the device for all gradients, read once (one sync on CUDA, not one each).
  torch::NoGradGuard no_grad;
  torch::Tensor all_finite;
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) {
        const auto finite = torch::isfinite(p.grad()).all();
        all_finite = all_finite.defined() ? all_finite.logical_and(finite) : finite;
      }
    }
  }
  return !all_finite.defined() || all_finite.item<bool>();
}

void Trainer::drop_window() {
  window_batches_ = 0;
  window_count_ = 0;
  window_non_finite_ = false;
  if (grad_ready_) {
    grad_ready_->clear();
  }
}

void Trainer::optimizer_failed(StepContext& ctx, detail::OptimizerStepGuard& guard,
                               const std::exception* error) {
  const auto changed = guard.changed();
  guard.restore_unchanged();
  // Policies see the step's gradients still in place; the window goes however this ends.
  const auto drop = c10::make_scope_exit([this] {
    drop_window();
    zero_grads();
  });
  if (error == nullptr) {
    throw;
  }
  if (!changed.empty()) {
    const auto partial = partial_error("the optimizer step", changed, *error);
    for (auto& policy : policies_) {
      try {
        policy->on_optimizer_error(ctx, partial);
      } catch (...) {
        // The partial update is what the caller must hear of.
      }
    }
    throw partial;
  }
  for (auto& policy : policies_) {
    policy->on_optimizer_error(ctx, *error);  // may raise a clearer error instead
  }
  throw;
}

void Trainer::check_not_halted() const {
  FRUGAL_CHECK(halted_.empty(), "frugal: the trainer refuses to go on after a partial update (",
               halted_, "); load a saved model and optimizer state, or call "
               "accept_partial_update() to train on from the model as it is");
}

void Trainer::accept_partial_update() { halted_.clear(); }

bool Trainer::flush() {
  check_not_halted();
  if (window_batches_ == 0) {
    return false;
  }
  StepReport report;
  Batch none;
  StepContext ctx(*this, none, report);
  optimizer_phase(ctx, window_count_, /*ends_batch=*/false);
  return true;
}

}  // namespace frugal
