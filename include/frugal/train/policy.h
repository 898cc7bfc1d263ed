// Policies: code that hooks the named phases of a training step.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "frugal/memory/probe.h"
#include "frugal/train/batch.h"
#include "frugal/train/port.h"
#include "frugal/train/step_report.h"
#include "frugal/traits.h"

namespace frugal {

/// The phases of one step, in order. Forward and backward phases run once per micro-batch;
/// the optimizer phases once per optimizer step.
enum class Phase {
  StepBegin,
  BeforeForward,
  AfterForward,
  BeforeBackward,
  AfterBackward,
  BeforeOptimizerStep,
  AfterOptimizerStep,
  AfterZeroGrad,
  StepEnd,
};

const char* phase_name(Phase phase);

/// What a policy sees of the step in progress.
struct StepContext {
  /// A step (or trial, `trial` true) of `batch` under the engine `port`.
  StepContext(PolicyPort& port, const Batch& batch, StepReport& report, bool trial = false)
      : port(port),
        module(port.module()),
        optimizer(port.optimizer()),
        probe(port.probe()),
        batch(batch),
        report(report),
        trial(trial) {}

  PolicyPort& port;  ///< the engine: micro-batch control, counters, the loss scale
  torch::nn::Module& module;
  torch::optim::Optimizer& optimizer;
  const MemoryProbe& probe;
  const Batch& batch;           ///< the whole batch of this call
  Batch micro;                  ///< the micro-batch in flight (forward/backward phases)
  std::int64_t micro_index = 0;
  std::int64_t micro_count = 0;
  /// From AfterForward on: the micro-batch's loss, already weighted by its share of the
  /// global count (zero for a micro-batch whose count is zero). A policy may replace it
  /// before backward (a GradScaler multiplies it).
  torch::Tensor loss;
  /// Set in BeforeOptimizerStep to skip the optimizer step (e.g. inf/NaN gradients).
  bool skip_optimizer_step = false;
  StepReport& report;
  /// A Trainer::trial: measure only; parameters and optimizer must not change.
  bool trial = false;
  /// Parameters that a policy updated during this step's backward (on_grad_ready). After
  /// the first, a failed attempt cannot be retried: the engine raises PartialStepError.
  std::vector<torch::Tensor> updated_in_backward;
  /// The count this optimizer step's gradients are divided by (the accumulation window's
  /// samples or tokens on this process); set from the backward that completes the step.
  std::int64_t window_count = 0;
  /// Set before BeforeOptimizerStep when the engine's guard (TrainerOptions::
  /// skip_non_finite) found the step's loss NaN or infinite: the step will be skipped. A
  /// policy that shares the step among processes makes them agree (DataParallel does).
  bool non_finite = false;
};

/// A policy hooks phases of the step. Names: a policy is named for what it does to the step
/// (ClipGrad, OomRecovery, StepInBackward, LrSchedule, LeakGuard, DataParallel), with
/// `Policy` at the end only where the bare name is the mechanism it puts into the step
/// (AutocastGuard / AutocastPolicy, Checkpoint / CheckpointPolicy, GradScaler /
/// GradScalerPolicy, a hook / HookPolicy); its options are the class's name and `Options`,
/// as LibTorch pairs Linear and LinearOptions. Override what you need; the engine calls every
/// policy's hook in the order the policies were added, and the After* hooks of forward in
/// reverse order, even when the forward threw, so a policy can pair them like a guard.
///
/// Example:
///   struct PrintLoss : frugal::Policy {
///     std::string name() const override { return "print-loss"; }
///     void on_step_end(frugal::StepContext& c) override { fmt::print("{}\n", c.report.loss); }
///   };
class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string name() const = 0;

  virtual void on_step_begin(StepContext&) {}
  virtual void before_forward(StepContext&) {}
  virtual void after_forward(StepContext&) {}
  virtual void before_backward(StepContext&) {}
  virtual void after_backward(StepContext&) {}
  virtual void before_optimizer_step(StepContext&) {}
  virtual void after_optimizer_step(StepContext&) {}
  virtual void after_zero_grad(StepContext&) {}
  virtual void on_step_end(StepContext&) {}

  /// What the policy needs of the step and does to it (Trait), read once when it is added:
  /// the engine arranges what the traits ask for (gradient-ready calls, gradients kept
  /// aside for retries, its non-finite guard) and refuses policies whose traits clash.
  virtual Traits traits() const { return {}; }
  /// Trainer::add_policy calls it after the traits passed; throw to refuse the trainer
  /// (its optimizer, say).
  virtual void on_add(PolicyPort&) {}

  /// The step's forward or backward threw `error`. The engine has dropped everything the
  /// attempt made (graph, outputs, gradients). Return true to retry the same batch (the
  /// first policy that does wins; declare Trait::Retries); false lets the error through.
  virtual bool on_step_error(StepContext&, const std::exception&) { return false; }
  /// The optimizer phase (dividing the window's gradients, BeforeOptimizerStep, the
  /// optimizer's step) threw `error`. The engine has put back what it could: parameters and
  /// optimizer state are as before (else `error` is the PartialStepError about to be thrown),
  /// the window's gradients are dropped. Reset what was prepared for the step; a policy may
  /// throw an error of its own in place of `error` (OomRecovery does for out-of-memory).
  /// No retry: the step's memory does not depend on the micro-batch.
  virtual void on_optimizer_error(StepContext&, const std::exception&) {}
  /// Around an evaluation (Trainer::evaluate and evaluate_each): its forwards and losses run
  /// between these, the end called in reverse order even when the evaluation threw.
  /// AutocastPolicy evaluates under its autocast, as it trains (Lightning's precision does).
  virtual void on_evaluate_begin(PolicyPort&) {}
  virtual void on_evaluate_end(PolicyPort&) {}
  /// An evaluation chunk of `batch_size` samples threw; return true to go on from that
  /// chunk (with a smaller eval batch, PolicyPort::set_eval_batch, say).
  virtual bool on_eval_error(PolicyPort&, std::int64_t /*batch_size*/, const std::exception&) {
    return false;
  }
  /// Inside the backward that completes an optimizer step (the last micro-batch of the
  /// accumulation window's last batch), as soon as `param`'s gradient for that step is
  /// final: accumulated over the window and divided by its count, as the optimizer would
  /// see it. Runs inside autograd's backward, once per parameter that gets a gradient
  /// there; parameters whose gradient came only from earlier micro-batches get none.
  /// Called only for policies that declare Trait::GradReady.
  virtual void on_grad_ready(StepContext&, const torch::Tensor& /*param*/) {}

  /// What a saved training state (frugal::save_training_state) keeps of this policy: the
  /// state a resumed run needs to go on as if never stopped (a loss scale, a micro-batch
  /// chosen after an out-of-memory error). Stateless policies write nothing.
  virtual void save_state(torch::serialize::OutputArchive&) const {}
  /// Reads back what save_state wrote; throw (naming what is wrong) and change nothing
  /// when the archive does not fit.
  virtual void load_state(torch::serialize::InputArchive&) {}
};

/// A policy made of one user function at one phase: the engine's hooks.
///
/// Example:
///   trainer.add_hook(frugal::Phase::AfterBackward, [](frugal::StepContext& c) {
///     torch::nn::utils::clip_grad_norm_(c.module.parameters(), 1.0);
///   });
class HookPolicy : public Policy {
 public:
  using Fn = std::function<void(StepContext&)>;
  HookPolicy(Phase phase, Fn fn, std::string name = "hook");

  std::string name() const override { return name_; }
  void on_step_begin(StepContext& c) override { call(Phase::StepBegin, c); }
  void before_forward(StepContext& c) override { call(Phase::BeforeForward, c); }
  void after_forward(StepContext& c) override { call(Phase::AfterForward, c); }
  void before_backward(StepContext& c) override { call(Phase::BeforeBackward, c); }
  void after_backward(StepContext& c) override { call(Phase::AfterBackward, c); }
  void before_optimizer_step(StepContext& c) override { call(Phase::BeforeOptimizerStep, c); }
  void after_optimizer_step(StepContext& c) override { call(Phase::AfterOptimizerStep, c); }
  void after_zero_grad(StepContext& c) override { call(Phase::AfterZeroGrad, c); }
  void on_step_end(StepContext& c) override { call(Phase::StepEnd, c); }

 private:
  void call(Phase phase, StepContext& c) {
    if (phase == phase_) {
      fn_(c);
    }
  }
  Phase phase_;
  Fn fn_;
  std::string name_;
};

}  // namespace frugal
