// The Trainer's face: what a step, a trial and a flush do with the parts (src/train).
#include "frugal/train/trainer.h"

#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
#include <torch/torch.h>

#include "frugal/error.h"
#include "frugal/train/sink.h"
#include "internal.h"
#include "trainer_impl.h"

namespace frugal {

Trainer::Trainer(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
                 ForwardFn forward, LossFn loss, TrainerOptions options)
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
    : impl_(std::make_unique<Impl>(std::move(module), optimizer, std::move(forward),
                                   std::move(loss), std::move(batch_loss), std::move(options))) {
  auto& s = impl_->state;
  const auto ledger = detail::measure_ledger(s.probe.snapshot(), s.module_tensors, nullptr);
  if (ledger.weights > ledger.allocated) {
    TORCH_WARN("frugal: the module's weights (", ledger.weights,
               " bytes) were allocated "
               "before the counting CPU allocator was installed, so the probe does not count "
               "them; install it first (frugal::CountingAllocator::install() or a "
               "MemoryProbe) for exact figures");
  }
}

Trainer::~Trainer() = default;

const std::vector<std::shared_ptr<Policy>>& Trainer::policies() const {
  return impl_->policies.all();
}
std::int64_t Trainer::micro_batch() const { return impl_->state.counters.micro_batch; }
std::int64_t Trainer::eval_batch() const { return impl_->state.counters.eval_batch; }
const TrainerOptions& Trainer::options() const { return impl_->state.options; }
const MemoryProbe& Trainer::probe() const { return impl_->state.probe; }
torch::nn::Module& Trainer::module() { return *impl_->state.module; }
torch::optim::Optimizer& Trainer::optimizer() { return impl_->state.optimizer; }
std::int64_t Trainer::steps() const { return impl_->state.counters.steps; }
std::int64_t Trainer::skipped_steps() const { return impl_->state.counters.skipped; }
Traits Trainer::traits() const { return impl_->policies.traits(); }
const std::string& Trainer::halted() const { return impl_->state.halt.why(); }
void Trainer::accept_partial_update() { impl_->state.halt.lift(); }
bool Trainer::window_open() const { return impl_->state.window.open(); }
TrainerCounters Trainer::counters() const { return impl_->state.counters; }

void Trainer::set_micro_batch(std::int64_t size) {
  detail::check_at_least(size, 1, "micro_batch");
  impl_->state.counters.micro_batch = size;
}

void Trainer::set_eval_batch(std::int64_t size) {
  detail::check_at_least(size, 1, "eval_batch");
  impl_->state.counters.eval_batch = size;
}

void Trainer::restore_counters(const TrainerCounters& c) {
  auto& s = impl_->state;
  FRUGAL_CHECK(!window_open(), "frugal: cannot restore counters inside an accumulation window (",
               s.window.batches(), " of ", s.options.accumulate(), " batches run)");
  FRUGAL_CHECK(c.steps >= 0 && c.skipped >= 0 && c.skipped <= c.steps && c.batches >= 0 &&
                   c.micro_batch >= 0 && c.eval_batch >= 0,
               "frugal: invalid trainer counters: steps ", c.steps, ", skipped ", c.skipped,
               ", batches ", c.batches, ", micro_batch ", c.micro_batch, ", eval_batch ",
               c.eval_batch);
  s.counters = c;
  s.halt.lift();  // the whole state was put back: nothing is half-updated any more
}

Trainer& Trainer::add_policy(std::shared_ptr<Policy> policy) {
  auto& s = impl_->state;
  const Traits traits = impl_->policies.add(std::move(policy), *this);
  if (traits.has(Trait::GradReady) && !s.grad_ready) {
    auto* impl = impl_.get();
    s.grad_ready =
        std::make_unique<detail::GradReady>(s.optimizer, [impl](const torch::Tensor& param) {
          TORCH_INTERNAL_ASSERT(impl->state.backward_ctx != nullptr,
                                "gradient-ready call outside a step");
          impl->policies.grad_ready(*impl->state.backward_ctx, param);
        });
  }
  if (traits.has(Trait::OwnsNonFinite)) {
    s.guard.disable();  // the policy decides what a NaN or inf does to the step
  }
  s.module_tensors.refresh();  // a policy may have rearranged the module tree (on_add)
  return *this;
}

Trainer& Trainer::add_hook(Phase phase, HookPolicy::Fn fn) {
  FRUGAL_CHECK(fn != nullptr, "frugal: add_hook(", phase_name(phase), ") got an empty function");
  return add_policy(std::make_shared<HookPolicy>(phase, std::move(fn)));
}

Trainer& Trainer::add_sink(std::shared_ptr<ReportSink> sink) {
  FRUGAL_CHECK(sink != nullptr, "frugal: add_sink got a null sink");
  impl_->sinks.push_back(std::move(sink));
  return *this;
}

void Trainer::set_unscale(Unscale unscale) { impl_->unscale = std::move(unscale); }

void Trainer::unscale_gradients() {
  if (impl_->unscale) {
    impl_->unscale(impl_->state.optimizer);
  }
}

StepReport Trainer::step(const Batch& given) {
  auto& s = impl_->state;
  // Pinned once for a CUDA device: the micro-batches are views of it.
  const Batch batch = given.pinned_for(s.options.device());
  s.begin_timing();
  StepReport report = impl_->open_report(batch);
  // A bad count fails here, before anything is computed.
  s.plan.split_into(batch, s.counters.micro_batch, s.split);
  const auto release = c10::make_scope_exit([&s] { s.split.clear(); });

  auto& window = s.window;
  const bool window_start = !window.open();
  if (window_start) {
    window.zero();  // a window accumulates from nothing, whatever the caller left
  }
  const bool retries = impl_->policies.traits().has(Trait::Retries);
  ScopedPeak step_peak(s.probe);
  StepContext ctx(*this, batch, report);
  try {
    impl_->policies.run(&Policy::on_step_begin, ctx);
    impl_->runner.run(ctx, /*isolate=*/!window_start && retries);
  } catch (const PartialStepError&) {
    s.drop_window();
    window.zero();
    throw;
  } catch (...) {
    if (!window_start && !retries) {
      s.drop_window();
      TORCH_WARN("frugal: a step failed inside an accumulation window; the window's ",
                 "gradients were dropped and the next batch starts a new one");
    }
    throw;
  }
  if (window.completes_with_next()) {
    impl_->phase.run(ctx, window.count() + report.count, /*ends_batch=*/true);
  } else {
    window.add(report.count);
    ++s.counters.batches;
  }
  report.batch = s.counters.batches;
  report.peak = step_peak.end();
  report.time.total_ms = s.timer.finish();
  impl_->finish_report(report);
  impl_->policies.run(&Policy::on_step_end, ctx);
  for (auto& sink : impl_->sinks) {
    sink->write(report);
  }
  return report;
}

StepReport Trainer::trial(const Batch& given) {
  auto& s = impl_->state;
  const Batch batch = given.pinned_for(s.options.device());
  s.begin_timing();
  StepReport report = impl_->open_report(batch);
  auto aside = s.window.take();
  {
    ScopedPeak peak(s.probe);
    StepContext ctx(*this, batch, report, /*trial=*/true);
    try {
      impl_->policies.run(&Policy::on_step_begin, ctx);
      s.plan.split_into(batch, s.counters.micro_batch, s.split);
      const auto release = c10::make_scope_exit([&s] { s.split.clear(); });
      impl_->runner.run(ctx, /*isolate=*/false);
    } catch (...) {
      s.window.put_back(std::move(aside), /*add=*/false);
      throw;
    }
    for (auto& p : s.module->parameters()) {
      p.mutable_grad().reset();
    }
    report.peak = peak.end();
  }
  s.window.put_back(std::move(aside), /*add=*/false);
  report.time.total_ms = s.timer.finish();
  report.step = s.counters.steps;
  report.memory = s.probe.snapshot();
  return report;
}

bool Trainer::flush() {
  auto& s = impl_->state;
  s.halt.check();
  if (!s.window.open()) {
    return false;
  }
  StepReport report;
  Batch none;
  StepContext ctx(*this, none, report);
  s.begin_timing();
  impl_->phase.run(ctx, s.window.count(), /*ends_batch=*/false);
  s.timer.finish();
  return true;
}

StepReport Trainer::Impl::open_report(const Batch& batch) const {
  state.halt.check();
  StepReport report;
  report.samples = batch.size();
  FRUGAL_CHECK(report.samples > 0, "frugal: the batch is empty (0 samples)");
  return report;
}

void Trainer::Impl::finish_report(StepReport& report) {
  report.step = state.counters.steps;
  report.skipped_total = state.counters.skipped;
  const auto& groups = state.optimizer.param_groups();
  report.lr = groups.empty() ? 0.0 : groups.front().options().get_lr();
  report.memory = state.probe.snapshot();
  if (state.options.ledger()) {
    report.ledger = detail::measure_ledger(report.memory, state.module_tensors, &state.optimizer);
  }
}

}  // namespace frugal
