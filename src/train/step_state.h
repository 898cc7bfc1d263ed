// What the trainer's step runner, optimizer phase and face share.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../engine/batch_statistics.h"
#include "../engine/grad_ready.h"
#include "../engine/gradient_window.h"
#include "../engine/micro_batch_plan.h"
#include "../engine/non_finite_guard.h"
#include "../engine/phase_timer.h"
#include "../engine/step_halt.h"
#include "../memory/module_tensors.h"
#include "frugal/error.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/sharded.h"
#include "frugal/train/trainer.h"

namespace frugal::detail {

/// The model and its functions, the options, the probe, the engine's parts (micro-batch
/// plan, gradient window, non-finite guard, halt, gradient-ready hooks) and the counters of
/// one trainer. The options are checked first: a bad value is named before anything is made.
struct StepState {
  StepState(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
            Trainer::BatchForwardFn forward, Trainer::OutputLossFn loss,
            Trainer::BatchLossFn batch_loss, TrainerOptions options);

  /// Starts timing a step (or a flush) as the options' DeviceTiming says.
  void begin_timing() {
    const auto timing = options.device_timing();
    timer.begin(options.device(), timing == DeviceTiming::Events,
                timing == DeviceTiming::Synchronize);
  }
  /// Drops the window's gradients and forgets which were delivered in backward.
  void drop_window();
  /// The error for a step that changed the parameters `changed` (by `where`) before failing
  /// with `error`; the trainer halts until the caller decides.
  PartialStepError partial_error(const char* where, const std::vector<torch::Tensor>& changed,
                                 const std::exception& error);

  std::shared_ptr<torch::nn::Module> module;
  torch::optim::Optimizer& optimizer;
  Trainer::BatchForwardFn forward;  // with `loss`, or else
  Trainer::OutputLossFn loss;
  Trainer::BatchLossFn batch_loss;  // the loss of a micro-batch, forward included
  TrainerOptions options;
  MemoryProbe probe;
  optim::ShardedOptimizer* sharded;  // the optimizer, when it shards (ZeRO); else null
  ModuleTensors module_tensors;      // what the ledger counts as weights
  bool whole_batch;  // BatchStatistics::WholeBatch applies: micro_batches is set aside
  std::unique_ptr<GradReady> grad_ready;  // while a policy wants gradient-ready calls
  MicroBatchPlan plan;
  MicroBatchPlan::Split split;  // the batch in flight, cut by the plan
  GradientWindow window;
  NonFiniteGuard guard;
  StepHalt halt;
  BatchStatisticsCheck batch_statistics;
  TrainerCounters counters;
  std::map<std::string, double> metrics;  // the attempt in flight's, summed
  PhaseTimer timer;                       // the step's phase boundaries
  StepContext* backward_ctx = nullptr;    // the step whose backward is running
};

}  // namespace frugal::detail
