// The optimizer phase of a step: dividing the window's gradients, the optimizer step under
// the non-finite guard and the step guarantee (undone, or named and halting), and the
// counting that follows it.
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/torch.h>

#include <algorithm>

#include "../engine/step_guard.h"
#include "frugal/error.h"
#include "frugal/train/trainer.h"
#include "internal.h"
#include "parts.h"

namespace frugal {

namespace {

// Puts back what a failed optimizer step did not finish; returns what it had written.
std::vector<torch::Tensor> undo_unfinished(detail::OptimizerStepGuard& guard) {
  auto changed = guard.changed();
  guard.restore_unchanged();
  return changed;
}

}  // namespace

void Trainer::optimizer_phase(StepContext& ctx, std::int64_t window_count, bool ends_batch) {
  // The phase's time runs from the batch's last clock read (flush's own, without a batch).
  ctx.skip_optimizer_step = false;
  ctx.window_count = window_count;
  {
    // Until the optimizer step has returned, a failure leaves parameters, optimizer state
    // and counters as they were (the window's gradients, already divided, are dropped),
    // or says which parameters the optimizer had written before it failed.
    detail::OptimizerStepGuard guard(optimizer_);
    try {
      auto* ready = parts_->grad_ready.get();
      parts_->window.divide(window_count, [ready](const torch::Tensor& p) {
        return ready != nullptr && ready->delivered(p);  // divided when it was delivered
      });
      // Without a GradScaler, a NaN or infinite loss (or gradient) would poison the
      // weights: the step is skipped instead, and said so.
      ctx.non_finite = parts_->guard.enabled() && parts_->window.non_finite();
      for (auto& policy : policies_) {
        policy->before_optimizer_step(ctx);
      }
      if (!ctx.skip_optimizer_step && parts_->guard.skips(ctx.non_finite, optimizer_)) {
        ctx.skip_optimizer_step = true;
        ctx.report.non_finite = true;
      }
      if (!ctx.skip_optimizer_step) {
        optimizer_.step();
      }
    } catch (const std::exception& error) {
      optimizer_failed(ctx, undo_unfinished(guard), &error);
    } catch (...) {
      optimizer_failed(ctx, undo_unfinished(guard), nullptr);
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
  parts_->window.zero();
  for (auto& policy : policies_) {
    policy->after_zero_grad(ctx);
  }
  ctx.report.time.optimizer_ms = detail::lap(parts_->mark, options_.device());
}

void Trainer::drop_window() {
  parts_->window.drop();
  if (parts_->grad_ready) {
    parts_->grad_ready->clear();
  }
}

void Trainer::optimizer_failed(StepContext& ctx, const std::vector<torch::Tensor>& changed,
                               const std::exception* error) {
  // Policies see the step's gradients still in place; the window goes however this ends.
  const auto drop = c10::make_scope_exit([this] {
    drop_window();
    parts_->window.zero();
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

}  // namespace frugal
