#include "frugal/train/trainer.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "forward_scope.h"
#include "grad_ready.h"
#include "internal.h"
#include "../memory/module_tensors.h"
#include "frugal/optim/sharded.h"
#include "frugal/report/sink.h"
#include "frugal/error.h"

namespace frugal {

using detail::check_positive;
using detail::Clock;
using detail::ms_since;

Trainer::Trainer(std::shared_ptr<torch::nn::Module> module, ForwardFn forward,
                 torch::optim::Optimizer& optimizer, LossFn loss, TrainerOptions options)
    : Trainer(std::move(module), optimizer,
              forward ? BatchForwardFn([forward](const Batch& b) { return forward(b.inputs); })
                      : nullptr,
              loss ? OutputLossFn([loss](const torch::Tensor& output, const Batch& b) {
                return loss(output, b.targets);
              })
                   : nullptr,
              nullptr, std::move(options)) {}

Trainer::Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
                 BatchForwardFn forward, OutputLossFn loss, TrainerOptions options)
    : Trainer(std::move(module), optimizer, std::move(forward), std::move(loss), nullptr,
              std::move(options)) {}

Trainer::Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
                 BatchLossFn batch_loss, TrainerOptions options)
    : Trainer(std::move(module), optimizer, nullptr, nullptr, std::move(batch_loss),
              std::move(options)) {}

Trainer::Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
                 BatchForwardFn forward, OutputLossFn loss, BatchLossFn batch_loss,
                 TrainerOptions options)
    : module_(std::move(module)),
      forward_(std::move(forward)),
      optimizer_(optimizer),
      loss_(std::move(loss)),
      batch_loss_(std::move(batch_loss)),
      options_(std::move(options)),
      probe_(options_.device(), options_.memory_scope()) {
  FRUGAL_CHECK(module_ != nullptr, "frugal: Trainer needs a module, got a null pointer");
  FRUGAL_CHECK((forward_ && loss_) || batch_loss_,
               "frugal: Trainer needs a forward and a loss function, or a batch loss function");
  check_positive(options_.micro_batch(), "micro_batch");
  check_positive(options_.micro_batches(), "micro_batches");
  check_positive(options_.eval_batch(), "eval_batch");
  FRUGAL_CHECK(!(options_.micro_batch() && options_.micro_batches()),
               "frugal: set micro_batch (", *options_.micro_batch(), ") or micro_batches (",
               *options_.micro_batches(), "), not both");
  FRUGAL_CHECK(options_.accumulate() >= 1, "frugal: accumulate must be >= 1, got ",
               options_.accumulate());
  micro_batch_ = options_.micro_batch().value_or(0);
  eval_batch_ = options_.eval_batch().value_or(0);
  if (const auto* sharded = dynamic_cast<const optim::ShardedOptimizer*>(&optimizer_)) {
    optimizer_traits_ = sharded->traits();
  }
  module_tensors_ = std::make_unique<detail::ModuleTensors>(*module_);
  const auto ledger = detail::measure_ledger(probe_, *module_tensors_, nullptr);
  if (ledger.weights > ledger.allocated) {
    TORCH_WARN("frugal: the module's weights (", ledger.weights, " bytes) were allocated "
               "before the counting CPU allocator was installed, so the probe does not count "
               "them; install it first (frugal::CountingAllocator::install() or a "
               "MemoryProbe) for exact figures");
  }
}

Trainer::~Trainer() = default;

void Trainer::set_micro_batch(std::int64_t size) {
  FRUGAL_CHECK(size >= 1, "frugal: micro_batch must be >= 1, got ", size);
  micro_batch_ = size;
}

TrainerCounters Trainer::counters() const {
  return {steps_, skipped_, batches_, micro_batch_, eval_batch_};
}

void Trainer::restore_counters(const TrainerCounters& c) {
  FRUGAL_CHECK(!window_open(), "frugal: cannot restore counters inside an accumulation window (",
               window_batches_, " of ", options_.accumulate(), " batches run)");
  FRUGAL_CHECK(c.steps >= 0 && c.skipped >= 0 && c.skipped <= c.steps && c.batches >= 0 &&
                  c.micro_batch >= 0 && c.eval_batch >= 0,
               "frugal: invalid trainer counters: steps ", c.steps, ", skipped ", c.skipped,
               ", batches ", c.batches, ", micro_batch ", c.micro_batch, ", eval_batch ",
               c.eval_batch);
  steps_ = c.steps;
  skipped_ = c.skipped;
  batches_ = c.batches;
  micro_batch_ = c.micro_batch;
  eval_batch_ = c.eval_batch;
  halted_.clear();  // the whole state was put back: nothing is half-updated any more
}

torch::Tensor Trainer::loss_of(const Batch& micro) const {
  return batch_loss_ ? batch_loss_(micro) : loss_(forward_(micro), micro);
}

void Trainer::run_batch(StepContext& ctx, bool isolate, Split parts) {
  auto& report = ctx.report;
  // Gradients of earlier batches of the window wait aside, so that a failed attempt
  // cannot spoil them; they are added back when the batch succeeds.
  std::vector<torch::Tensor> aside;
  if (isolate) {
    aside = take_grads();
  }
  auto give_up = [&] {
    if (isolate) {
      put_back_grads(std::move(aside), /*add=*/false);
    }
  };
  for (bool first = true;; first = false) {
    const auto data_start = Clock::now();
    if (!first) {
      parts = split(ctx.batch);  // with the micro-batch size a policy chose
    }
    report.count = parts.total;
    report.micro_batches = static_cast<std::int64_t>(parts.micros.size());
    report.micro_batch = parts.micros.front().size();
    ctx.micro_count = report.micro_batches;
    report.time.data_ms += ms_since(data_start);
    try {
      run_micro_batches(ctx, parts.micros, parts.counts, parts.total, &aside);
      break;
    } catch (const std::exception& error) {
      // Drop everything the failed attempt made: its graph, outputs and gradients.
      ctx.loss = torch::Tensor();
      ctx.micro = Batch();
      parts = Split();
      for (auto& p : module_->parameters()) {
        p.mutable_grad().reset();
      }
      // Gradients handed out in backward may have changed parameters, or gone to other
      // processes: no retry then, and the window (part of it handed out) is dropped.
      if (grad_ready_ && grad_ready_->delivered_count() > 0) {
        grad_ready_->clear();
        give_up();
        if (!ctx.updated_in_backward.empty()) {
          throw partial_error("the optimizer step in backward", ctx.updated_in_backward, error);
        }
        drop_window();
        throw;
      }
      // A policy may ask for the batch to run again; one that gives up says why.
      bool retry = false;
      try {
        retry = std::any_of(policies_.begin(), policies_.end(), [&](const auto& policy) {
          return policy->on_step_error(ctx, error);
        });
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
    put_back_grads(std::move(aside), /*add=*/true);
  }
}

StepReport Trainer::step(const Batch& batch) {
  check_not_halted();
  const auto start = Clock::now();
  const std::int64_t samples = batch.size();
  FRUGAL_CHECK(samples > 0, "frugal: the batch is empty (0 samples)");
  auto parts = split(batch);  // a bad count fails here, before anything is computed

  StepReport report;
  report.samples = samples;
  const bool window_start = window_batches_ == 0;
  if (window_start) {
    zero_grads();  // a window accumulates from nothing, whatever the caller left
  }
  ScopedPeak step_peak(probe_);
  StepContext ctx(*this, batch, report);
  try {
    for (auto& policy : policies_) {
      policy->on_step_begin(ctx);
    }
    run_batch(ctx, !window_start && traits_.has(Trait::Retries), std::move(parts));
  } catch (const PartialStepError&) {
    drop_window();
    zero_grads();
    throw;
  } catch (...) {
    if (!window_start && !traits_.has(Trait::Retries)) {
      drop_window();
      TORCH_WARN("frugal: a step failed inside an accumulation window; the window's ",
                 "gradients were dropped and the next batch starts a new one");
    }
    throw;
  }
  if (window_batches_ + 1 == options_.accumulate()) {
    optimizer_phase(ctx, window_count_ + report.count, /*ends_batch=*/true);
  } else {
    window_count_ += report.count;
    ++window_batches_;
    ++batches_;
  }
  report.batch = batches_;
  report.peak = step_peak.end();
  report.time.total_ms = ms_since(start);
  finish_report(report);
  for (auto& policy : policies_) {
    policy->on_step_end(ctx);
  }
  for (auto& sink : sinks_) {
    sink->write(report);
  }
  return report;
}

StepReport Trainer::trial(const Batch& batch) {
  check_not_halted();
  const auto start = Clock::now();
  const std::int64_t samples = batch.size();
  FRUGAL_CHECK(samples > 0, "frugal: the batch is empty (0 samples)");
  StepReport report;
  report.samples = samples;
  auto aside = take_grads();
  {
    ScopedPeak peak(probe_);
    StepContext ctx(*this, batch, report, /*trial=*/true);
    try {
      for (auto& policy : policies_) {
        policy->on_step_begin(ctx);
      }
      run_batch(ctx, /*isolate=*/false, split(batch));
    } catch (...) {
      put_back_grads(std::move(aside), /*add=*/false);
      throw;
    }
    for (auto& p : module_->parameters()) {
      p.mutable_grad().reset();
    }
    report.peak = peak.end();
  }
  put_back_grads(std::move(aside), /*add=*/false);
  report.time.total_ms = ms_since(start);
  report.step = steps_;
  report.memory = probe_.snapshot();
  return report;
}

void Trainer::run_micro_batches(StepContext& ctx, const std::vector<Batch>& micros,
                                const std::vector<std::int64_t>& counts, std::int64_t total,
                                std::vector<torch::Tensor>* aside) {
  auto& report = ctx.report;
  const bool windowed = options_.accumulate() > 1;
  // Gradient-ready calls go out in the backward that completes the optimizer step, with
  // the window's division done there rather than before the optimizer step.
  const bool completes_step = ctx.trial || window_batches_ + 1 == options_.accumulate();
  const double ready_scale =
      windowed && !ctx.trial ? 1.0 / static_cast<double>(window_count_ + total) : 1.0;
  const bool mean = options_.reduction() == LossReduction::Mean;
  ctx.window_count = ctx.trial ? total : window_count_ + total;
  const bool in_backward_guard = guards_non_finite() && traits_.has(Trait::UpdatesInBackward);
  torch::Tensor loss_sum;  // several micro-batches: summed on the device, read once
  double logged = 0;
  for (std::size_t i = 0; i < micros.size(); ++i) {
    auto t = Clock::now();
    ctx.micro = micros[i].to(options_.device());
    ctx.micro_index = static_cast<std::int64_t>(i);
    report.time.data_ms += ms_since(t);

    t = Clock::now();
    {
      ScopedPeak forward_peak(probe_);
      {
        detail::ForwardScope scope(policies_, ctx);
        torch::Tensor loss = loss_of(ctx.micro);
        FRUGAL_CHECK(loss.defined() && loss.numel() == 1,
                     "frugal: the loss must be a scalar, got a tensor of shape ",
                     loss.defined() ? loss.sizes() : torch::IntArrayRef{});
        FRUGAL_CHECK(loss.requires_grad(),
                     "frugal: the loss does not require grad (is the module frozen, or was the "
                     "forward run under no_grad?)");
        if (loss.dim() != 0) {
          loss = loss.reshape({});
        }
        // The weight makes the sum over micro-batches the gradient of the batch's mean
        // loss; within an accumulation window, the division by the window's count waits
        // for its end. A micro-batch that counts nothing (all padding) weighs nothing:
        // its mean over nothing is NaN, so it is replaced by a zero that keeps the graph.
        const bool counts_nothing = mean && counts[i] == 0;
        const double share = mean ? static_cast<double>(counts[i]) : 1.0;
        const double weight = windowed ? share : share / static_cast<double>(total);
        if (counts_nothing) {
          loss = loss.nan_to_num(0.0, 0.0, 0.0) * 0.0;
        } else if (micros.size() == 1) {
          logged = loss.item<double>() * share;  // one read, as a plain loop does
        } else {
          const auto detached = loss.detach().to(torch::kDouble) * share;
          loss_sum = loss_sum.defined() ? loss_sum + detached : detached;
        }
        ctx.loss = weight == 1.0 || counts_nothing ? loss : loss * weight;
      }  // AfterForward hooks see ctx.loss
      report.forward_peak = std::max(report.forward_peak, forward_peak.end());
    }
    report.time.forward_ms += ms_since(t);

    t = Clock::now();
    if (completes_step && !ctx.trial && i + 1 == micros.size() && in_backward_guard) {
      // A policy updates parameters during this backward, where no later check can stop a
      // NaN or inf from reaching them: a non-finite window skips its last backward, and
      // the optimizer phase skips the step.
      const double seen = loss_sum.defined() ? loss_sum.item<double>() : logged;
      if (window_non_finite_ || !std::isfinite(seen)) {
        window_non_finite_ = true;
        ctx.loss = torch::Tensor();
        ctx.micro = Batch();
        report.time.backward_ms += ms_since(t);
        break;
      }
    }
    for (auto& policy : policies_) {
      policy->before_backward(ctx);
    }
    {
      ScopedPeak backward_peak(probe_);
      const bool armed = grad_ready_ && completes_step && i + 1 == micros.size();
      if (armed) {
        grad_ready_->clear();
      }
      backward_ctx_ = &ctx;
      detail::ArmedScope arm(armed ? grad_ready_.get() : nullptr, aside, ready_scale);
      ctx.loss.backward();
      ctx.loss = torch::Tensor();
      report.backward_peak = std::max(report.backward_peak, backward_peak.end());
    }
    for (auto& policy : policies_) {
      policy->after_backward(ctx);
    }
    ctx.micro = Batch();
    report.time.backward_ms += ms_since(t);
  }
  if (loss_sum.defined()) {
    logged = loss_sum.item<double>();
  }
  report.loss = logged / static_cast<double>(total);
  window_non_finite_ = window_non_finite_ || (!ctx.trial && !std::isfinite(report.loss));
}

void Trainer::finish_report(StepReport& report) {
  report.step = steps_;
  report.skipped_total = skipped_;
  const auto& groups = optimizer_.param_groups();
  report.lr = groups.empty() ? 0.0 : groups.front().options().get_lr();
  report.memory = probe_.snapshot();
  if (options_.ledger()) {
    report.ledger = detail::measure_ledger(probe_, *module_tensors_, &optimizer_);
  }
}

}  // namespace frugal
