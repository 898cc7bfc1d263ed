// The user's own training loop, made exact and frugal: several models and optimizers, the
// user's forward and loss, frugal's accumulation, loss scaling, guards and memory report.
#pragma once

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "frugal/memory/leak_check.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/memory_context.h"
#include "frugal/memory/probe.h"
#include "frugal/memory/timeline_window.h"
#include "frugal/nn/module_pointer.h"
#include "frugal/train/batch.h"
#include "frugal/train/options.h"
#include "frugal/train/reducer.h"

namespace frugal {

class GradScaler;
class ReportSink;

/// Options of frugal::Loop.
///
/// Example:
///   auto options = frugal::LoopOptions().micro_batch(16).scaler(
///       std::make_shared<frugal::GradScaler>());
struct LoopOptions {
  /// Loop::accumulate cuts a batch into micro-batches of at most this many samples (>= 1).
  /// Unset: the whole batch at once.
  TORCH_ARG(c10::optional<std::int64_t>, micro_batch) = c10::nullopt;
  /// What a (micro-)batch counts for Loop::accumulate, e.g. non-padding tokens. Unset:
  /// samples.
  TORCH_ARG(std::function<std::int64_t(const Batch&)>, count) = nullptr;
  /// How Loop::accumulate's loss function reduces over a micro-batch, and so what the
  /// gradient is: the batch's mean, its sum, or its sum over its count (see LossReduction).
  TORCH_ARG(LossReduction, reduction) = LossReduction::Mean;
  /// What Loop::accumulate does when micro-batches would change what a BatchNorm layer
  /// computes (see BatchStatistics): warn once a model naming the layers, refuse, accept,
  /// or run such a model's batches whole until an out-of-memory error cuts them.
  TORCH_ARG(BatchStatistics, batch_statistics) = BatchStatistics::Warn;
  /// On an out-of-memory error inside Loop::accumulate, halve the micro-batch (down to 1) and
  /// run the batch again from its first micro-batch, the gradients before the call kept: the
  /// effective batch and its gradient stay as they were. The smaller size stays.
  TORCH_ARG(bool, oom_recovery) = false;
  /// Release a model's gradients after its step instead of filling them with zeros.
  TORCH_ARG(bool, set_to_none) = true;
  /// One loss scaler over every model's optimizer (PyTorch's GradScaler over several):
  /// each loss is scaled before backward, each optimizer unscaled and checked at its step,
  /// and the scale updated once per iteration, at Loop::end. Null: no scaling.
  TORCH_ARG(std::shared_ptr<GradScaler>, scaler) = nullptr;
  /// Data parallelism (distributed::Reducer): each model's gradients are made the mean over
  /// the processes before its step, in buckets sent while the backward that ends the step
  /// goes on (every backward outside Loop::NoSync; the last micro-batch of accumulate), and
  /// the processes agree on every skip. Each process backpropagates the loss of its equal
  /// share of the batch. Under a ZeRO optimizer of stage 2 or 3 each process keeps only its
  /// share of the gradients (and of stage 3's weights between steps). Null: one process.
  TORCH_ARG(std::shared_ptr<GradientReducer>, reducer) = nullptr;
  /// Without a scaler, skip a model's step when a loss backpropagated into it since its last
  /// step was NaN or infinite (or, with check_gradients, any of its gradients is).
  TORCH_ARG(bool, skip_non_finite) = true;
  TORCH_ARG(bool, check_gradients) = false;
  /// The device whose memory the reports measure.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// Whose bytes the reports count on the CPU (see MemoryScope).
  TORCH_ARG(MemoryScope, memory_scope) = MemoryScope::Thread;
  /// Measure the ledger (weights, gradients, optimizer state of every model) at Loop::end.
  TORCH_ARG(bool, ledger) = true;
  /// Check at every Loop::end of an iteration in which a model stepped that the allocated
  /// bytes came back to the baseline (LeakCheck; LeakError names the growth). Unset: no check.
  TORCH_ARG(c10::optional<LeakGuardOptions>, leak_guard) = c10::nullopt;
  /// Records iterations `first` to `last` with a MemoryRecorder of `device` watching every
  /// prepared model and optimizer, and writes the span's file when the last iteration ends (Loop::end).
  /// Between the Loop's verbs the thread's phase is then `forward`: what the user's code
  /// allocates there (its forward passes) is counted as activations.
  TORCH_ARG(c10::optional<MemoryTimelineSpan>, memory_timeline) = c10::nullopt;
};

/// A model and its optimizer, as Loop::prepare registered them.
class LoopModel {
 public:
  const std::string& name() const { return name_; }
  torch::nn::Module& module() { return *module_; }
  torch::optim::Optimizer& optimizer() { return optimizer_; }
  std::int64_t steps() const { return steps_; }
  std::int64_t skipped_steps() const { return skipped_; }
  ~LoopModel();

 private:
  friend class Loop;
  struct Parts;
  LoopModel(std::string name, std::shared_ptr<torch::nn::Module> module,
            torch::optim::Optimizer& optimizer, const LoopOptions& options);

  std::string name_;
  std::shared_ptr<torch::nn::Module> module_;
  torch::optim::Optimizer& optimizer_;
  std::unique_ptr<Parts> parts_;
  std::int64_t steps_ = 0;
  std::int64_t skipped_ = 0;
};

/// What one iteration did to one model.
struct LoopModelReport {
  std::string name;
  double loss = 0;  ///< sum of the losses backpropagated into it this iteration
  std::int64_t backwards = 0;
  std::int64_t oom_retries = 0;  ///< accumulate calls run again with a smaller micro-batch
  bool stepped = false;          ///< its optimizer step ran
  bool skipped = false;          ///< its step was skipped (inf/NaN)
  std::int64_t steps = 0;        ///< steps so far
};

/// One iteration of a Loop, from the previous Loop::end to this one.
struct LoopReport {
  std::int64_t iteration = 0;  ///< iterations ended so far
  std::vector<LoopModelReport> models;
  double scale = 1;                       ///< the loss scale after the update (1 without a scaler)
  std::map<std::string, double> metrics;  ///< what Loop::log recorded this iteration
  MemorySnapshot memory;                  ///< at the end (after the steps released gradients)
  std::int64_t peak = 0;                  ///< peak allocated bytes during the iteration
  Ledger ledger;                          ///< every model's weights, gradients and optimizer state

  const LoopModelReport& model(const std::string& name) const;
  std::string summary() const;
  /// One JSON object: iteration, models, scale, metrics and the memory fields of a
  /// StepReport's JSON (allocated_bytes, peak_bytes, weights_bytes, grads_bytes, ...).
  std::string to_json() const;
};

/// A training loop the user writes, with frugal's pieces as verbs (Accelerate's shape):
/// prepare each model with its optimizer, backpropagate each loss into the model it trains
/// (only that model's parameters receive gradients, so a loss that flows through another
/// model, as a GAN generator's through the discriminator, never leaks into that model's next
/// step and costs it no gradient memory), step the models whose optimizers should step, and
/// end the iteration for one report. Autocast (AutocastGuard), checkpointed blocks
/// (nn::call, nn::Checkpoint), frugal's optimizers and BatchNorm work inside as they do
/// anywhere.
///
/// A failed optimizer step leaves the model's parameters, optimizer state and gradients as
/// they were, or raises PartialStepError when some parameters had already changed.
///
/// Example:
///   frugal::Loop loop(frugal::LoopOptions().scaler(scaler));
///   auto& d = loop.prepare(discriminator, d_adam, "discriminator");
///   auto& g = loop.prepare(generator, g_adam, "generator");
///   for (auto& real : batches) {
///     auto fake = generator->forward(torch::randn({n, 64}));
///     loop.backward(bce(discriminator->forward(real), ones), d);
///     loop.backward(bce(discriminator->forward(fake.detach()), zeros), d);
///     loop.step(d);
///     loop.backward(bce(discriminator->forward(fake), ones), g);
///     loop.step(g);
///     fmt::print("{}\n", loop.end().summary());
///   }
class Loop {
 public:
  /// The loss of one micro-batch (reduced by its mean over the micro-batch).
  using MicroLossFn = std::function<torch::Tensor(const Batch& micro)>;

  explicit Loop(LoopOptions options = {});
  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  /// Backwards into `model` while it lives send nothing to the other processes: their
  /// gradients add up locally and travel with the next backward outside it, or at the step
  /// (DDP's no_sync, Accelerate's accumulate). Without a reducer it changes nothing.
  ///
  /// Example:
  ///   { frugal::Loop::NoSync quiet(loop, d);  loop.backward(real_loss, d); }
  ///   loop.backward(fake_loss, d);  // the sum of both is reduced during this backward
  class NoSync {
   public:
    NoSync(Loop& loop, LoopModel& model);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    LoopModel& model_;
  };

  /// Registers a model (a module holder or a std::shared_ptr to a module) and the optimizer
  /// that trains it, under a name the reports use. The returned handle lives as the Loop.
  template <typename Model>
  LoopModel& prepare(const Model& model, torch::optim::Optimizer& optimizer, std::string name) {
    return prepare_module(nn::module_pointer(model), optimizer, std::move(name));
  }

  /// Backpropagates `loss` (a scalar) into `model`'s trainable parameters only, scaled by the
  /// scaler if there is one; gradients add up until the model's step.
  void backward(const torch::Tensor& loss, LoopModel& model, bool retain_graph = false);
  /// The model's last backward of its step with the step fused into it (the optimizer step in
  /// backward, as frugal::StepInBackward): each parameter is updated, and its gradient freed,
  /// as soon as autograd has accumulated it, so the model's gradients never exist all at once.
  /// The result equals backward then step: parameters whose gradient came only from earlier
  /// backwards are stepped after it. A NaN or infinite loss (this one or an earlier one
  /// since the last step) runs the plain backward and skips the step, as step() does.
  /// Needs one of frugal's optimizers (frugal::optim::SGD, Adam, AdamW); refused with a loss
  /// scaler, a reducer or check_gradients, which need every gradient before any update.
  /// Returns whether it stepped. If backward fails after a parameter was updated, raises
  /// PartialStepError naming those parameters.
  bool backward_step(const torch::Tensor& loss, LoopModel& model);
  /// Exact gradient accumulation: cuts `batch` into micro-batches (LoopOptions::micro_batch),
  /// calls `micro_loss` on each and backpropagates it into `model` weighted by its share of
  /// the batch, so the gradient is the whole batch's loss's: its mean, or its sum
  /// (LoopOptions::reduction). Returns that loss per count (a sum divided by the samples).
  double accumulate(const Batch& batch, LoopModel& model, const MicroLossFn& micro_loss);
  /// Unscales (with a scaler), decides the skip on inf/NaN, steps the model's optimizer and
  /// releases its gradients. Returns whether it stepped. At most once per iteration with a
  /// scaler (its per-optimizer bookkeeping, as PyTorch's).
  bool step(LoopModel& model);
  /// Records a number for this iteration's report (accuracy, a discriminator's output).
  void log(const std::string& name, double value);
  /// Ends the iteration: updates the scale once, measures memory, hands the report to the
  /// sinks and returns it.
  LoopReport end();
  /// Adds a sink that receives every report of Loop::end (frugal::ConsoleSink,
  /// frugal::JsonLinesSink, or one of the caller's).
  Loop& add_sink(std::shared_ptr<ReportSink> sink);

  /// Whether a model has gradients waiting for its step (a saved state does not hold them).
  bool pending() const;
  /// Puts back the counters a saved state holds (frugal::load_training_state, which puts
  /// back everything else): iterations, and each model's steps and skipped steps.
  void restore_counters(std::int64_t iterations,
                        const std::vector<std::pair<std::int64_t, std::int64_t>>& steps);

  /// The micro-batch size accumulate cuts batches into now (0: whole batches).
  std::int64_t micro_batch() const { return micro_batch_; }
  const LoopOptions& options() const { return options_; }
  const MemoryProbe& probe() const { return probe_; }
  /// The memory timeline of LoopOptions::memory_timeline (null without one): its recorder
  /// and the file it wrote.
  const MemoryTimelineWindow* memory_timeline() const { return timeline_.get(); }
  std::int64_t iterations() const { return iterations_; }
  const std::vector<std::unique_ptr<LoopModel>>& models() const { return models_; }

 private:
  LoopModel& prepare_module(std::shared_ptr<torch::nn::Module> module,
                            torch::optim::Optimizer& optimizer, std::string name);
  void check_own(const LoopModel& model, const char* verb) const;
  static void check_loss(const torch::Tensor& loss, const LoopModel& model);
  // Completes a reduction a backward began, before another backward into the model.
  static void settle(LoopModel& model);
  // backward of a checked scalar loss, `logged` x `factor` added to the model's losses (read
  // on the host only where a decision needs it before the step); `aside`: gradients of
  // earlier backwards held apart (accumulate's), added before a reduction.
  void backward_logged(const torch::Tensor& loss, const torch::Tensor& logged, double factor,
                       LoopModel& model, bool retain_graph,
                       std::vector<torch::Tensor>* aside = nullptr);
  // Counts the model's step (or skip), releases its gradients and starts its next step.
  void finish_step(LoopModel& model, bool stepped);
  // Loop::NoSync's: one guard more (+1) or less (-1) over the model's backwards.
  static void quiet(LoopModel& model, int change);

  LoopOptions options_;
  MemoryProbe probe_;
  std::vector<std::unique_ptr<LoopModel>> models_;
  std::map<std::string, double> metrics_;
  std::int64_t iterations_ = 0;
  std::int64_t micro_batch_ = 0;
  bool scaled_ = false;  // the scaler scaled a loss this iteration
  c10::optional<LeakCheck> leak_;
  std::vector<std::shared_ptr<ReportSink>> sinks_;
  // Begins the next iteration of LoopOptions::memory_timeline.
  void begin_timeline();
  std::unique_ptr<MemoryTimelineWindow> timeline_;
  std::unique_ptr<PhaseScope> between_verbs_;  // forward, while the timeline records
};

}  // namespace frugal
