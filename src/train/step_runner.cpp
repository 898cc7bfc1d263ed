#include "step_runner.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "forward_scope.h"
#include "frugal/error.h"
#include "frugal/memory/memory_context.h"

namespace frugal::detail {

// The batch's logged loss: one read for one micro-batch, as a plain loop does; for several,
// summed on the device and read once.
namespace {

torch::Tensor checked_loss(torch::Tensor loss) {
  FRUGAL_CHECK(loss.defined() && loss.numel() == 1,
               "frugal: the loss must be a scalar, got a tensor of shape ",
               loss.defined() ? loss.sizes() : torch::IntArrayRef{});
  FRUGAL_CHECK(loss.requires_grad(),
               "frugal: the loss does not require grad (is the module frozen, or was the "
               "forward run under no_grad?)");
  return loss.dim() != 0 ? loss.reshape({}) : loss;
}

}  // namespace

torch::Tensor StepRunner::loss_of(const Batch& micro) {
  if (state_.batch_loss) {
    return checked_loss(state_.batch_loss(micro));
  }
  const auto output = state_.forward(micro);
  if (state_.options.metrics()) {
    torch::NoGradGuard no_grad;
    for (const auto& [name, value] : state_.options.metrics()(output.detach(), micro)) {
      state_.metrics[name] += value;
    }
  }
  return checked_loss(state_.loss(output, micro));
}

void StepRunner::run(StepContext& ctx, bool isolate) {
  auto& report = ctx.report;
  auto& window = state_.window;
  auto& split = state_.split;
  // Gradients of earlier batches of the window wait aside, so that a failed attempt
  // cannot spoil them; they are added back when the batch succeeds.
  std::vector<torch::Tensor> aside;
  if (isolate) {
    aside = window.take();
  }
  auto give_up = [&] {
    if (isolate) {
      window.put_back(std::move(aside), /*add=*/false);
    }
  };
  for (bool first = true;; first = false) {
    state_.timer.lap(nullptr, false);  // data time runs on into the first micro-batch's
    if (!first) {
      state_.plan.split_into(ctx.batch, state_.counters.micro_batch,
                             split);  // the size a policy chose
    }
    report.count = split.total;
    report.micro_batches = static_cast<std::int64_t>(split.micros.size());
    report.micro_batch = split.micros.front().size();
    state_.batch_statistics.check(*state_.module, report.micro_batches, report.micro_batch);
    ctx.micro_count = report.micro_batches;
    state_.metrics.clear();  // a retried attempt counts from nothing
    try {
      run_micro_batches(ctx, &aside);
      report.metrics = state_.metrics;
      break;
    } catch (const std::exception& error) {
      // Drop everything the failed attempt made: its graph, outputs and gradients.
      ctx.loss = torch::Tensor();
      ctx.micro = Batch();
      split.clear();
      for (auto& p : state_.module->parameters()) {
        p.mutable_grad().reset();
      }
      // Gradients handed out in backward may have changed parameters, or gone to other
      // processes: no retry then, and the window (part of it handed out) is dropped.
      auto& ready = state_.grad_ready;
      if (ready && ready->delivered_count() > 0) {
        ready->clear();
        give_up();
        if (!ctx.updated_in_backward.empty()) {
          throw state_.partial_error("the optimizer step in backward", ctx.updated_in_backward,
                                     error);
        }
        state_.drop_window();
        throw;
      }
      // A policy may ask for the batch to run again; one that gives up says why.
      bool retry = false;
      try {
        retry = policies_.retry(ctx, error);
      } catch (...) {
        give_up();
        throw;
      }
      if (!retry) {
        give_up();
        throw;
      }
      ++report.oom_retries;
    }
  }
  if (isolate) {
    window.put_back(std::move(aside), /*add=*/true);
  }
}

void StepRunner::run_micro_batches(StepContext& ctx, std::vector<torch::Tensor>* aside) {
  auto& report = ctx.report;
  const auto& split = state_.split;
  const auto& window = state_.window;
  // Gradient-ready calls go out in the backward that completes the optimizer step, with
  // the window's division done there rather than before the optimizer step.
  const bool completes_step = ctx.trial || window.completes_with_next();
  ctx.window_count = ctx.trial ? split.total : window.count() + split.total;
  const double ready_scale = ctx.trial ? 1.0 : window.scale(ctx.window_count);
  detail::LossTally log;  // read once, after the backwards are launched
  auto& timer = state_.timer;
  for (std::size_t i = 0; i < split.micros.size(); ++i) {
    ctx.micro = split.micros[i].to(state_.options.device());
    ctx.micro_index = static_cast<std::int64_t>(i);
    timer.lap(&report.time.data_ms, /*device_work=*/false);

    {
      ScopedPeak forward_peak(state_.probe);
      {
        const PhaseScope phase(MemoryPhase::Forward);
        ForwardScope scope(policies_.all(), ctx);
        ctx.loss = weigh(loss_of(ctx.micro), split.counts[i], split.total, log);
      }  // AfterForward hooks see ctx.loss
      report.forward_peak = std::max(report.forward_peak, forward_peak.end());
    }
    timer.lap(&report.time.forward_ms);

    const bool last = i + 1 == split.micros.size();
    if (completes_step && last && skips_last_backward(ctx, log)) {
      ctx.loss = torch::Tensor();
      ctx.micro = Batch();
      timer.lap(&report.time.backward_ms);
      break;
    }
    backward(ctx, completes_step && last, aside, ready_scale);
    timer.lap(&report.time.backward_ms);
  }
  report.loss = log.value() / static_cast<double>(split.total);
  if (!ctx.trial && !std::isfinite(report.loss)) {
    state_.window.mark_non_finite();
  }
}

torch::Tensor StepRunner::weigh(torch::Tensor loss, std::int64_t count, std::int64_t total,
                                detail::LossTally& log) const {
  // The weight makes the sum over micro-batches the gradient of the batch's loss (its mean,
  // or its sum: LossReduction); within an accumulation window, the division by the window's
  // count waits for its end (GradientWindow). A micro-batch that counts nothing (all padding)
  // weighs nothing: its mean over nothing is NaN, so it is replaced by a zero that keeps the graph.
  const bool mean = state_.options.reduction() == LossReduction::Mean;
  if (mean && count == 0) {
    return loss.nan_to_num(0.0, 0.0, 0.0) * 0.0;
  }
  const double share = state_.window.share(count);
  log.add(loss, share);
  const double weight = state_.window.weight(share, total);
  return weight == 1.0 ? loss : loss * weight;
}

bool StepRunner::skips_last_backward(const StepContext& ctx, detail::LossTally& log) {
  // A policy that updates parameters during backward leaves no later check to stop a NaN
  // or inf from reaching them: a non-finite window skips its last backward, and the
  // optimizer phase skips the step.
  const bool updates = policies_.traits().has(Trait::UpdatesInBackward) ||
                       policies_.optimizer_traits().has(Trait::UpdatesSharesInBackward);
  if (ctx.trial || !state_.guard.enabled() || !updates) {
    return false;
  }
  if (!state_.window.non_finite() && std::isfinite(log.value())) {
    return false;
  }
  state_.window.mark_non_finite();
  return true;
}

void StepRunner::backward(StepContext& ctx, bool completes_step, std::vector<torch::Tensor>* aside,
                          double ready_scale) {
  policies_.run(&Policy::before_backward, ctx);
  {
    const PhaseScope phase(MemoryPhase::Backward);
    ScopedPeak backward_peak(state_.probe);
    auto* ready = completes_step ? state_.grad_ready.get() : nullptr;
    if (ready != nullptr) {
      ready->clear();
    }
    state_.backward_ctx = &ctx;
    ArmedScope arm(ready, aside, ready_scale);
    ctx.loss.backward();
    ctx.loss = torch::Tensor();
    ctx.report.backward_peak = std::max(ctx.report.backward_peak, backward_peak.end());
  }
  policies_.run(&Policy::after_backward, ctx);
  ctx.micro = Batch();
}

}  // namespace frugal::detail
