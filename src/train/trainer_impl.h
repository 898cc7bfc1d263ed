// What the Trainer's face holds: the state its parts share, and the parts.
#pragma once

#include <memory>
#include <vector>

#include "frugal/train/trainer.h"
#include "optimizer_phase.h"
#include "policy_set.h"
#include "step_runner.h"
#include "step_state.h"

namespace frugal {

struct Trainer::Impl {
  Impl(std::shared_ptr<torch::nn::Module> module, torch::optim::Optimizer& optimizer,
       BatchForwardFn forward, OutputLossFn loss, BatchLossFn batch_loss, TrainerOptions options)
      : state(std::move(module), optimizer, std::move(forward), std::move(loss),
              std::move(batch_loss), std::move(options)),
        policies(state.sharded != nullptr ? state.sharded->traits() : Traits{}),
        runner(state, policies),
        phase(state, policies) {}

  /// The report of a step or trial of `batch`, its samples counted; refused while halted
  /// or for an empty batch.
  StepReport open_report(const Batch& batch) const;
  /// The report's counters, learning rate, memory figures and ledger, after a step.
  void finish_report(StepReport& report);
  /// evaluate() of one batch, in chunks; the report goes to no sink.
  EvalReport evaluate_chunks(PolicyPort& port, const Batch& data,
                             c10::optional<std::int64_t> batch_size);

  detail::StepState state;
  detail::PolicySet policies;
  detail::StepRunner runner;
  detail::OptimizerPhase phase;
  Unscale unscale;  // a policy's that scales the loss
  std::vector<std::shared_ptr<ReportSink>> sinks;
};

}  // namespace frugal
