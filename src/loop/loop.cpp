#include "frugal/loop/loop.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "../engine/in_backward.h"
#include "../engine/micro_batch_plan.h"
#include "../engine/non_finite_guard.h"
#include "../engine/oom_backoff.h"
#include "../engine/partial_step.h"
#include "../engine/step_guard.h"
#include "frugal/error.h"
#include "frugal/memory/memory_context.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/train/sink.h"
#include "parts.h"

namespace frugal {

LoopModel::LoopModel(std::string name, std::shared_ptr<torch::nn::Module> module,
                     torch::optim::Optimizer& optimizer, const LoopOptions& options)
    : name_(std::move(name)),
      module_(std::move(module)),
      optimizer_(optimizer),
      parts_(std::make_unique<Parts>(*module_, optimizer, options)) {
  parts_->iteration.name = name_;
}

LoopModel::~LoopModel() = default;

Loop::Loop(LoopOptions options)
    : options_(std::move(options)), probe_(options_.device(), options_.memory_scope()) {
  FRUGAL_CHECK(!options_.micro_batch() || *options_.micro_batch() >= 1,
               "frugal: LoopOptions micro_batch must be >= 1, got ", *options_.micro_batch());
  micro_batch_ = options_.micro_batch().value_or(0);
  if (options_.memory_timeline()) {
    timeline_ = std::make_unique<MemoryTimelineWindow>(*options_.memory_timeline());
    begin_timeline();
  }
  probe_.reset_peak();
}

void Loop::begin_timeline() {
  if (timeline_->end()) {
    between_verbs_.reset();
  }
  if (auto* recorder = timeline_->begin(options_.device())) {
    for (const auto& m : models_) {
      recorder->watch(m->module(), &m->optimizer(), m->name());
    }
    between_verbs_ = std::make_unique<PhaseScope>(MemoryPhase::Forward);
  }
}

Loop::~Loop() = default;

LoopModel& Loop::prepare_module(std::shared_ptr<torch::nn::Module> module,
                                torch::optim::Optimizer& optimizer, std::string name) {
  FRUGAL_CHECK(module != nullptr, "frugal: Loop::prepare of '", name, "' needs a module");
  FRUGAL_CHECK(!name.empty(), "frugal: Loop::prepare needs a name for the reports");
  for (const auto& m : models_) {
    FRUGAL_CHECK(m->name() != name, "frugal: Loop::prepare: the name '", name,
                 "' is taken by another model");
    FRUGAL_CHECK(&m->optimizer() != &optimizer, "frugal: Loop::prepare of '", name,
                 "': its optimizer already trains '", m->name(), "'");
  }
  // Checked and attached before it joins the loop: a refused model leaves the loop as it was.
  std::unique_ptr<LoopModel> added(
      new LoopModel(std::move(name), std::move(module), optimizer, options_));
  auto& parts = *added->parts_;
  FRUGAL_CHECK(!parts.trainable.empty(), "frugal: Loop::prepare of '", added->name(),
               "': its optimizer holds no parameter that requires grad");
  if (options_.reducer()) {
    auto* sharded = detail::sharded_optimizer(optimizer);
    if (sharded != nullptr && sharded->traits().has(Trait::KeepsGradients)) {
      detail::check_compatible(
          gradient_readers(options_),
          {fmt::format("the optimizer of '{}'", added->name()), Trait::KeepsGradients});
    }
    parts.reducer = options_.reducer()->attach(added->module(), optimizer);
    parts.sync = std::make_unique<detail::GradReady>(optimizer, [&parts](const torch::Tensor& p) {
      parts.reducer->add(p, {1, parts.non_finite});
    });
    parts.reducer->begin();
  }
  models_.push_back(std::move(added));
  auto& model = *models_.back();
  if (timeline_ != nullptr && timeline_->recorder() != nullptr &&
      timeline_->recorder()->recording()) {
    timeline_->recorder()->watch(model.module(), &model.optimizer(), model.name());
  }
  return model;
}

void Loop::check_own(const LoopModel& model, const char* verb) const {
  for (const auto& m : models_) {
    if (m.get() == &model) {
      return;
    }
  }
  FRUGAL_CHECK(false, "frugal: Loop::", verb, " of '", model.name(),
               "', a model another Loop prepared");
}

void Loop::backward(const torch::Tensor& loss, LoopModel& model, bool retain_graph) {
  check_own(model, "backward");
  check_loss(loss, model);
  backward_logged(loss, loss, 1.0, model, retain_graph);
}

void Loop::settle(LoopModel& model) {
  auto& parts = *model.parts_;
  if (!parts.open) {
    return;
  }
  // A backward after one that reduced: that reduction is completed first. The mean of the
  // processes' sums is the sum of their means, as every process holds the same reduced part.
  FRUGAL_CHECK(!parts.reducer->keeps_gradients(), "frugal: Loop::backward into '", model.name(),
               "': its gradients were reduced by an earlier backward since its step, and its "
               "optimizer keeps only its share of them; backpropagate the earlier losses under "
               "Loop::NoSync, or through Loop::accumulate");
  parts.non_finite = parts.reducer->finalize({1, parts.non_finite}).non_finite;
  parts.open = false;
}

void Loop::check_loss(const torch::Tensor& loss, const LoopModel& model) {
  FRUGAL_CHECK(loss.defined() && loss.numel() == 1, "frugal: Loop::backward into '", model.name(),
               "' needs a scalar loss, got a tensor of shape ",
               loss.defined() ? loss.sizes() : torch::IntArrayRef{});
  FRUGAL_CHECK(loss.requires_grad(), "frugal: Loop::backward into '", model.name(),
               "': the loss does not require grad (was the forward run under no_grad?)");
}

void Loop::backward_logged(const torch::Tensor& loss, const torch::Tensor& logged, double factor,
                           LoopModel& model, bool retain_graph, std::vector<torch::Tensor>* aside) {
  auto& parts = *model.parts_;
  auto root = loss.reshape({});
  const auto& scaler = options_.scaler();
  if (scaler && scaler->is_enabled()) {
    root = scaler->scale(root);
    scaled_ = true;
  }
  settle(model);
  const bool sync = parts.reducer && parts.quiet == 0;
  const auto term = parts.losses.step.term(logged, factor);  // one read on the CPU
  parts.losses.step.add(term);
  parts.losses.iteration.add(term);
  if (sync) {
    if (parts.reducer->agrees_in_backward()) {
      // The ranks agree on a non-finite loss as this backward's first bucket leaves.
      parts.read_non_finite();
    }
    parts.sync->clear();
    parts.open = true;
  }
  {
    const PhaseScope phase(MemoryPhase::Backward);
    detail::ArmedScope arm(sync ? parts.sync.get() : nullptr, aside, 1.0);
    torch::autograd::backward({root}, {}, retain_graph, /*create_graph=*/false, parts.trainable);
  }
  parts.pending = true;
  ++parts.iteration.backwards;
}

double Loop::accumulate(const Batch& batch, LoopModel& model, const MicroLossFn& micro_loss) {
  check_own(model, "accumulate");
  FRUGAL_CHECK(micro_loss != nullptr, "frugal: Loop::accumulate into '", model.name(),
               "' needs a loss function");
  const detail::MicroBatchPlan plan(c10::nullopt, options_.count());
  auto& parts = *model.parts_;
  settle(model);
  // The gradients from before this call wait aside when a failure may run the batch again.
  std::vector<torch::Tensor> aside;
  if (options_.oom_recovery()) {
    aside = parts.window.take();
  }
  const auto before = parts.iteration;
  const auto losses_before = parts.losses;
  const bool pending = parts.pending;
  const bool non_finite = parts.non_finite;
  while (true) {
    // A model with BatchNorm layers under BatchStatistics::WholeBatch runs its batches whole
    // until an out-of-memory error cuts them.
    const std::int64_t size = parts.whole_batch ? 0 : micro_batch_;
    try {
      const auto split = plan.split(batch, size);
      parts.batch_statistics.check(model.module(), static_cast<std::int64_t>(split.micros.size()),
                                   split.micros.front().size());
      detail::LossTally logged;  // read once, when every backward is launched
      for (std::size_t i = 0; i < split.micros.size(); ++i) {
        const auto loss = [&] {
          const PhaseScope forward(MemoryPhase::Forward);
          return micro_loss(split.micros[i]);
        }();
        FRUGAL_CHECK(loss.defined() && loss.numel() == 1, "frugal: Loop::accumulate into '",
                     model.name(), "': the micro-batch loss must be a scalar");
        const double share = parts.window.share(split.counts[i]);
        const double weight = parts.window.weight(share, split.total);
        // The batch's loss per count in every reduction, as the Trainer reports it.
        const double factor = share / static_cast<double>(split.total);
        logged.add(loss, factor);
        // Only the last micro-batch's backward reduces, the earlier gradients added to it.
        c10::optional<NoSync> quiet;
        if (i + 1 < split.micros.size()) {
          quiet.emplace(*this, model);
        }
        const auto weighted = loss * weight;
        check_loss(weighted, model);
        backward_logged(weighted, loss, factor, model, false, &aside);
      }
      if (options_.oom_recovery()) {
        parts.window.put_back(std::move(aside), /*add=*/true);
      }
      // One loss of the batch in the report, not one per micro-batch.
      parts.iteration.backwards -= static_cast<std::int64_t>(split.micros.size()) - 1;
      return logged.value();
    } catch (const c10::OutOfMemoryError& error) {
      if (!options_.oom_recovery() || parts.open) {
        throw;  // without recovery, or gradients began to travel: not run again
      }
      // This call's partial gradients go, and what the report and the model held before it
      // comes back; the gradients from before come back too if the batch cannot run again.
      parts.window.zero();
      const auto retries = parts.iteration.oom_retries;
      parts.iteration = before;
      parts.losses = losses_before;
      parts.iteration.oom_retries = retries + 1;
      parts.pending = pending;
      parts.non_finite = non_finite;
      try {
        micro_batch_ =
            detail::back_off(size > 0 ? size : batch.size(), 1, probe_, error,
                             "The model, its optimizer and its gradients are as before the call.");
        parts.whole_batch = false;
      } catch (...) {
        parts.iteration.oom_retries = retries;
        parts.window.put_back(std::move(aside), /*add=*/false);
        throw;
      }
    } catch (...) {
      if (options_.oom_recovery()) {  // as without recovery: the gradients from before stay
        parts.window.put_back(std::move(aside), /*add=*/true);
      }
      throw;
    }
  }
}

bool Loop::step(LoopModel& model) {
  check_own(model, "step");
  auto& parts = *model.parts_;
  FRUGAL_CHECK(parts.pending, "frugal: Loop::step of '", model.name(),
               "' before any backward into it since its last step");
  auto& optimizer = model.optimizer();
  const auto& scaler = options_.scaler();
  const bool scaling = scaler && scaler->is_enabled();
  // What no backward reduced yet travels now; without a scaler the processes agree on the
  // skip, and with one an inf on one process reaches every process's scaler.
  const bool non_finite = parts.reducer
                              ? parts.reducer->finalize({1, parts.read_non_finite()}).non_finite
                              : parts.read_non_finite();
  parts.open = false;
  bool go = false;
  {
    detail::OptimizerStepGuard guard(optimizer);
    try {
      go = scaling ? scaler->prepare_step(optimizer)
                   : !detail::NonFiniteGuard(options_.skip_non_finite(), options_.check_gradients())
                          .skips(non_finite, optimizer);
      if (go) {
        const PhaseScope phase(MemoryPhase::OptimizerStep);
        optimizer.step();
      }
    } catch (const std::exception& error) {
      const auto changed = guard.changed();
      guard.restore_unchanged();
      if (scaling) {
        scaler->discard_step(optimizer);
      }
      if (changed.empty()) {
        throw;
      }
      throw detail::partial_step_error(
          model.module(), fmt::format("the optimizer step of '{}'", model.name()), changed, error,
          "the others and the model's gradients are as before");
    }
  }
  finish_step(model, go);
  return go;
}

void Loop::finish_step(LoopModel& model, bool stepped) {
  auto& parts = *model.parts_;
  ++(stepped ? model.steps_ : model.skipped_);
  parts.window.zero();
  parts.pending = false;
  parts.non_finite = false;
  parts.losses.step.clear();
  parts.iteration.stepped = stepped;
  parts.iteration.skipped = !stepped;
  if (parts.reducer) {
    parts.reducer->begin();  // stage 3: the next forward's weights
  }
}

Loop::NoSync::NoSync(Loop& loop, LoopModel& model) : model_(model) {
  loop.check_own(model, "NoSync");
  quiet(model_, +1);
}

Loop::NoSync::~NoSync() { quiet(model_, -1); }

void Loop::quiet(LoopModel& model, int change) { model.parts_->quiet += change; }

void Loop::log(const std::string& name, double value) { metrics_[name] = value; }

Loop& Loop::add_sink(std::shared_ptr<ReportSink> sink) {
  FRUGAL_CHECK(sink != nullptr, "frugal: Loop::add_sink got a null sink");
  sinks_.push_back(std::move(sink));
  return *this;
}

bool Loop::pending() const {
  for (const auto& m : models_) {
    if (m->parts_->pending) {
      return true;
    }
  }
  return false;
}

void Loop::restore_counters(std::int64_t iterations,
                            const std::vector<std::pair<std::int64_t, std::int64_t>>& steps) {
  FRUGAL_CHECK(steps.size() == models_.size(), "frugal: Loop::restore_counters got ", steps.size(),
               " models' counters for ", models_.size(), " models");
  FRUGAL_CHECK(iterations >= 0, "frugal: invalid loop iterations ", iterations);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    FRUGAL_CHECK(steps[i].first >= 0 && steps[i].second >= 0, "frugal: invalid counters of '",
                 models_[i]->name(), "': steps ", steps[i].first, ", skipped ", steps[i].second);
  }
  iterations_ = iterations;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    models_[i]->steps_ = steps[i].first;
    models_[i]->skipped_ = steps[i].second;
  }
}

LoopReport Loop::end() {
  const auto& scaler = options_.scaler();
  LoopReport report;
  if (scaler && scaler->is_enabled()) {
    if (scaled_) {
      scaler->update();  // once, over every optimizer's findings
    }
    report.scale = scaler->get_scale();
  }
  scaled_ = false;
  report.iteration = ++iterations_;
  report.metrics = std::move(metrics_);
  metrics_.clear();
  report.memory = probe_.snapshot();
  report.peak = report.memory.peak_allocated;

  for (auto& m : models_) {
    auto& it = m->parts_->iteration;
    it.steps = m->steps_;
    it.loss = m->parts_->losses.iteration.value();
    if (m->parts_->reducer) {  // the ranks' mean, as the Trainer reports the global batch's
      it.loss = m->parts_->reducer->global_loss(it.loss);
    }
    m->parts_->losses.iteration.clear();
    report.models.push_back(it);
    it = LoopModelReport{m->name()};
    if (options_.ledger()) {
      const auto ledger =
          detail::measure_ledger(report.memory, m->parts_->tensors, &m->optimizer());
      report.ledger.weights += ledger.weights;
      report.ledger.gradients += ledger.gradients;
      report.ledger.optimizer += ledger.optimizer;
      report.ledger.allocated = ledger.allocated;
    }
  }
  if (options_.ledger()) {
    const auto& l = report.ledger;
    report.ledger.other = l.allocated - l.weights - l.gradients - l.optimizer;
  }
  probe_.reset_peak();
  for (const auto& sink : sinks_) {
    sink->write(report);
  }
  if (timeline_ != nullptr) {
    begin_timeline();  // writes the file after the span's last iteration
  }
  if (options_.leak_guard()) {
    if (!leak_) {
      leak_.emplace(*options_.leak_guard());
    }
    const bool stepped = std::any_of(report.models.begin(), report.models.end(),
                                     [](const auto& m) { return m.stepped; });
    if (stepped) {  // gradients held for a later step are meant to stay
      leak_->observe(report.memory.allocated, report.iteration);
    }
  }
  return report;
}

}  // namespace frugal
