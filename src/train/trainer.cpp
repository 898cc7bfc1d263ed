#include "frugal/train/trainer.h"

#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "../memory/module_tensors.h"
#include "frugal/error.h"
#include "frugal/optim/sharded.h"
#include "frugal/train/sink.h"
#include "internal.h"
#include "parts.h"

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
  FRUGAL_CHECK(!(options_.micro_batch() && options_.micro_batches()), "frugal: set micro_batch (",
               *options_.micro_batch(), ") or micro_batches (", *options_.micro_batches(),
               "), not both");
  FRUGAL_CHECK(options_.accumulate() >= 1, "frugal: accumulate must be >= 1, got ",
               options_.accumulate());
  const bool whole_batch = detail::keeps_whole_batch(options_.batch_statistics(), *module_);
  micro_batch_ = whole_batch ? 0 : options_.micro_batch().value_or(0);
  eval_batch_ = options_.eval_batch().value_or(0);
  parts_ = std::make_unique<Parts>(*module_, optimizer_, options_, whole_batch);
  if (parts_->sharded != nullptr) {
    optimizer_traits_ = parts_->sharded->traits();
  }
  const auto ledger = detail::measure_ledger(probe_.snapshot(), *parts_->module_tensors, nullptr);
  if (ledger.weights > ledger.allocated) {
    TORCH_WARN("frugal: the module's weights (", ledger.weights,
               " bytes) were allocated "
               "before the counting CPU allocator was installed, so the probe does not count "
               "them; install it first (frugal::CountingAllocator::install() or a "
               "MemoryProbe) for exact figures");
  }
}

Trainer::~Trainer() = default;

const std::string& Trainer::halted() const { return parts_->halt.why(); }

void Trainer::accept_partial_update() { parts_->halt.lift(); }

bool Trainer::window_open() const { return parts_->window.open(); }

void Trainer::set_micro_batch(std::int64_t size) {
  FRUGAL_CHECK(size >= 1, "frugal: micro_batch must be >= 1, got ", size);
  micro_batch_ = size;
}

TrainerCounters Trainer::counters() const {
  return {steps_, skipped_, batches_, micro_batch_, eval_batch_};
}

void Trainer::restore_counters(const TrainerCounters& c) {
  FRUGAL_CHECK(!window_open(), "frugal: cannot restore counters inside an accumulation window (",
               parts_->window.batches(), " of ", options_.accumulate(), " batches run)");
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
  parts_->halt.lift();  // the whole state was put back: nothing is half-updated any more
}

StepReport Trainer::step(const Batch& batch) {
  parts_->halt.check();
  const auto start = Clock::now();
  const std::int64_t samples = batch.size();
  FRUGAL_CHECK(samples > 0, "frugal: the batch is empty (0 samples)");
  // A bad count fails here, before anything is computed.
  parts_->plan.split_into(batch, micro_batch_, parts_->split);
  const auto release = c10::make_scope_exit([this] { parts_->split.clear(); });

  StepReport report;
  report.samples = samples;
  auto& window = parts_->window;
  const bool window_start = !window.open();
  if (window_start) {
    window.zero();  // a window accumulates from nothing, whatever the caller left
  }
  const bool retries = traits_.has(Trait::Retries);
  ScopedPeak step_peak(probe_);
  StepContext ctx(*this, batch, report);
  try {
    for (auto& policy : policies_) {
      policy->on_step_begin(ctx);
    }
    run_batch(ctx, /*isolate=*/!window_start && retries);
  } catch (const PartialStepError&) {
    drop_window();
    window.zero();
    throw;
  } catch (...) {
    if (!window_start && !retries) {
      drop_window();
      TORCH_WARN("frugal: a step failed inside an accumulation window; the window's ",
                 "gradients were dropped and the next batch starts a new one");
    }
    throw;
  }
  if (window.completes_with_next()) {
    optimizer_phase(ctx, window.count() + report.count, /*ends_batch=*/true);
  } else {
    window.add(report.count);
    ++batches_;
  }
  report.batch = batches_;
  report.peak = step_peak.end();
  report.time.total_ms = ms_since(start, options_.device());
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
  parts_->halt.check();
  const auto start = Clock::now();
  const std::int64_t samples = batch.size();
  FRUGAL_CHECK(samples > 0, "frugal: the batch is empty (0 samples)");
  StepReport report;
  report.samples = samples;
  auto& window = parts_->window;
  auto aside = window.take();
  {
    ScopedPeak peak(probe_);
    StepContext ctx(*this, batch, report, /*trial=*/true);
    try {
      for (auto& policy : policies_) {
        policy->on_step_begin(ctx);
      }
      parts_->plan.split_into(batch, micro_batch_, parts_->split);
      const auto release = c10::make_scope_exit([this] { parts_->split.clear(); });
      run_batch(ctx, /*isolate=*/false);
    } catch (...) {
      window.put_back(std::move(aside), /*add=*/false);
      throw;
    }
    for (auto& p : module_->parameters()) {
      p.mutable_grad().reset();
    }
    report.peak = peak.end();
  }
  window.put_back(std::move(aside), /*add=*/false);
  report.time.total_ms = ms_since(start, options_.device());
  report.step = steps_;
  report.memory = probe_.snapshot();
  return report;
}

bool Trainer::flush() {
  parts_->halt.check();
  if (!parts_->window.open()) {
    return false;
  }
  StepReport report;
  Batch none;
  StepContext ctx(*this, none, report);
  parts_->mark = Clock::now();
  optimizer_phase(ctx, parts_->window.count(), /*ends_batch=*/false);
  return true;
}

void Trainer::finish_report(StepReport& report) {
  report.step = steps_;
  report.skipped_total = skipped_;
  const auto& groups = optimizer_.param_groups();
  report.lr = groups.empty() ? 0.0 : groups.front().options().get_lr();
  report.memory = probe_.snapshot();
  if (options_.ledger()) {
    report.ledger = detail::measure_ledger(report.memory, *parts_->module_tensors, &optimizer_);
  }
}

}  // namespace frugal
