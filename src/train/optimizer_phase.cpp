#include "optimizer_phase.h"

#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/torch.h>

#include <algorithm>

#include "../engine/step_guard.h"
#include "frugal/error.h"
#include "frugal/memory/memory_context.h"

namespace frugal::detail {

namespace {

// Puts back what a failed optimizer step did not finish; returns what it had written.
std::vector<torch::Tensor> undo_unfinished(OptimizerStepGuard& guard) {
  auto changed = guard.changed();
  guard.restore_unchanged();
  return changed;
}

}  // namespace

void OptimizerPhase::run(StepContext& ctx, std::int64_t window_count, bool ends_batch) {
  // The phase's time runs from the batch's last clock read (flush's own, without a batch).
  ctx.skip_optimizer_step = false;
  ctx.window_count = window_count;
  {
    // Until the optimizer step has returned, a failure leaves parameters, optimizer state
    // and counters as they were (the window's gradients, already divided, are dropped),
    // or says which parameters the optimizer had written before it failed.
    OptimizerStepGuard guard(state_.optimizer);
    try {
      auto* ready = state_.grad_ready.get();
      state_.window.divide(window_count, [ready](const torch::Tensor& p) {
        return ready != nullptr && ready->delivered(p);  // divided when it was delivered
      });
      // Without a GradScaler, a NaN or infinite loss (or gradient) would poison the
      // weights: the step is skipped instead, and said so.
      ctx.non_finite = state_.guard.enabled() && state_.window.non_finite();
      policies_.run(&Policy::before_optimizer_step, ctx);
      if (!ctx.skip_optimizer_step && state_.guard.skips(ctx.non_finite, state_.optimizer)) {
        ctx.skip_optimizer_step = true;
        ctx.report.non_finite = true;
      }
      if (!ctx.skip_optimizer_step) {
        const PhaseScope phase(MemoryPhase::OptimizerStep);
        state_.optimizer.step();
      }
    } catch (const std::exception& error) {
      failed(ctx, undo_unfinished(guard), &error);
    } catch (...) {
      failed(ctx, undo_unfinished(guard), nullptr);
    }
  }
  // The step is applied: from here on the trainer counts it, whatever a later hook does.
  state_.counters.skipped += ctx.skip_optimizer_step ? 1 : 0;
  ++state_.counters.steps;
  state_.counters.batches += ends_batch ? 1 : 0;
  state_.drop_window();
  ctx.report.stepped = true;
  ctx.report.skipped = ctx.skip_optimizer_step;
  policies_.run(&Policy::after_optimizer_step, ctx);
  state_.window.zero();
  policies_.run(&Policy::after_zero_grad, ctx);
  state_.timer.lap(&ctx.report.time.optimizer_ms);
}

void OptimizerPhase::failed(StepContext& ctx, const std::vector<torch::Tensor>& changed,
                            const std::exception* error) {
  // Policies see the step's gradients still in place; the window goes however this ends.
  const auto drop = c10::make_scope_exit([this] {
    state_.drop_window();
    state_.window.zero();
  });
  if (error == nullptr) {
    throw;
  }
  if (!changed.empty()) {
    const auto partial = state_.partial_error("the optimizer step", changed, *error);
    policies_.optimizer_failed(ctx, partial, /*quietly=*/true);  // the caller hears of this
    throw partial;
  }
  policies_.optimizer_failed(ctx, *error, /*quietly=*/false);  // may raise a clearer one
  throw;
}

}  // namespace frugal::detail
