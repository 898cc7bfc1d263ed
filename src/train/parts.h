// The parts the trainer owns, which its public header only names.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "../engine/grad_ready.h"
#include "../engine/gradient_window.h"
#include "../engine/in_backward.h"
#include "../engine/micro_batch_plan.h"
#include "../engine/non_finite_guard.h"
#include "../engine/step_halt.h"
#include "../memory/module_tensors.h"
#include "batch_statistics.h"
#include "frugal/train/trainer.h"
#include "internal.h"

namespace frugal {

struct Trainer::Parts {
  // `whole_batch`: BatchStatistics::WholeBatch applies, micro_batches is set aside.
  Parts(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
        const TrainerOptions& options, bool whole_batch)
      : sharded(detail::sharded_optimizer(optimizer)),
        module_tensors(std::make_unique<detail::ModuleTensors>(module)),
        plan(whole_batch ? c10::nullopt : options.micro_batches(), options.count()),
        window(optimizer, options.accumulate(), options.set_to_none()),
        guard(options.skip_non_finite(), options.check_gradients()),
        batch_statistics(options.batch_statistics()) {}

  optim::ShardedOptimizer* sharded;  // the optimizer, when it shards (ZeRO); else null
  std::unique_ptr<detail::ModuleTensors> module_tensors;  // what the ledger counts as weights
  std::unique_ptr<detail::GradReady> grad_ready;  // while a policy wants gradient-ready calls
  detail::MicroBatchPlan plan;
  detail::MicroBatchPlan::Split split;  // the batch in flight, cut by the plan
  detail::GradientWindow window;
  detail::NonFiniteGuard guard;
  detail::StepHalt halt;
  detail::BatchStatisticsCheck batch_statistics;
  std::map<std::string, double> metrics;  // the attempt in flight's, summed
  detail::Clock::time_point mark;         // the attempt's last boundary between phases
};

}  // namespace frugal
