// What frugal::Loop keeps of each model, shared by the Loop's sources.
#pragma once

#include <cmath>
#include <memory>
#include <vector>

#include "../engine/batch_statistics.h"
#include "../engine/compatibility.h"
#include "../engine/grad_ready.h"
#include "../engine/gradient_window.h"
#include "../engine/loss_tally.h"
#include "../memory/module_tensors.h"
#include "frugal/error.h"
#include "frugal/loop/loop.h"
#include "frugal/optim/in_place.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/train/reducer.h"

namespace frugal {

// The loop's options that read every gradient of a step, as parties to the one table of
// refusals (a loss scaler, check_gradients).
inline std::vector<detail::Party> gradient_readers(const LoopOptions& options) {
  std::vector<detail::Party> present;
  const auto& scaler = options.scaler();
  if (scaler && scaler->is_enabled()) {
    present.push_back({"the loop's loss scaler", Trait::AllGradients});
  }
  if (options.check_gradients()) {
    present.push_back({"the loop's check_gradients", Trait::AllGradients});
  }
  return present;
}

// A model's own pieces: the parameters its backward reaches, its gradient window (the
// weights of micro-batch losses, releasing gradients), the tensors the ledger counts, and
// what happened to it since its last step and in this iteration.
struct LoopModel::Parts {
  Parts(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const LoopOptions& options)
      : window(optimizer, /*accumulate=*/1, options.set_to_none(), options.reduction()),
        tensors(module),
        batch_statistics(options.batch_statistics()),
        whole_batch(detail::keeps_whole_batch(options.batch_statistics(), module)) {
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (p.requires_grad()) {
          trainable.push_back(p);
        }
      }
    }
  }
  std::vector<torch::Tensor> trainable;
  detail::GradientWindow window;
  detail::ModuleTensors tensors;
  // BatchNorm under accumulate's micro-batches: the choice, and whether this model's batches
  // run whole (BatchStatistics::WholeBatch) until an out-of-memory error cuts them.
  detail::BatchStatisticsCheck batch_statistics;
  bool whole_batch;
  bool pending = false;     // a backward reached it since its last step
  bool non_finite = false;  // a loss of those was NaN or infinite (as read so far)
  // The losses backpropagated since the last step (whether one was NaN or infinite) and in
  // this iteration (its report), read on the host when a decision or the report needs them.
  struct Losses {
    detail::LossTally step;
    detail::LossTally iteration;
  } losses;
  // Whether a loss since the last step was NaN or infinite: reads the device's losses.
  bool read_non_finite() {
    non_finite = non_finite || !std::isfinite(losses.step.value());
    return non_finite;
  }
  LoopModelReport iteration;
  // Loop::backward_step's: the optimizer as one that updates a parameter at a time and the
  // hooks that update each parameter as its gradient is ready, both set at the first call
  // the options allow, and the parameters updated in the current one.
  optim::InPlaceOptimizer* in_place = nullptr;
  std::unique_ptr<detail::GradReady> ready;
  std::vector<torch::Tensor> updated;
  // Data parallelism: the model's reducer, the hooks that add each gradient to it as it is
  // ready, whether a reduction is open (begun by a backward, not finalized), and the
  // Loop::NoSync guards alive.
  std::unique_ptr<ModelReducer> reducer;
  std::unique_ptr<detail::GradReady> sync;
  bool open = false;
  int quiet = 0;
};

}  // namespace frugal
