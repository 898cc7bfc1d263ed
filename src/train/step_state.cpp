#include "step_state.h"

#include <fmt/format.h>

#include "../engine/in_backward.h"
#include "../engine/partial_step.h"
#include "internal.h"

namespace frugal::detail {
namespace {

std::shared_ptr<torch::nn::Module> checked(std::shared_ptr<torch::nn::Module> module,
                                           bool has_functions) {
  FRUGAL_CHECK(module != nullptr, "frugal: Trainer needs a module, got a null pointer");
  FRUGAL_CHECK(has_functions,
               "frugal: Trainer needs a forward and a loss function, or a batch loss function");
  return module;
}

TrainerOptions checked(TrainerOptions options) {
  check_positive(options.micro_batch(), "micro_batch");
  check_positive(options.micro_batches(), "micro_batches");
  check_positive(options.eval_batch(), "eval_batch");
  FRUGAL_CHECK(!(options.micro_batch() && options.micro_batches()), "frugal: set micro_batch (",
               *options.micro_batch(), ") or micro_batches (", *options.micro_batches(),
               "), not both");
  frugal::detail::check_at_least(options.accumulate(), 1, "accumulate");
  return options;
}

}  // namespace

StepState::StepState(std::shared_ptr<torch::nn::Module> module_,
                     torch::optim::Optimizer& optimizer_, Trainer::BatchForwardFn forward_,
                     Trainer::OutputLossFn loss_, Trainer::BatchLossFn batch_loss_,
                     TrainerOptions options_)
    : module(checked(std::move(module_), (forward_ && loss_) || batch_loss_)),
      optimizer(optimizer_),
      forward(std::move(forward_)),
      loss(std::move(loss_)),
      batch_loss(std::move(batch_loss_)),
      options(checked(std::move(options_))),
      probe(options.device(), options.memory_scope()),
      sharded(sharded_optimizer(optimizer)),
      module_tensors(*module),
      whole_batch(keeps_whole_batch(options.batch_statistics(), *module)),
      plan(whole_batch ? c10::nullopt : options.micro_batches(), options.count()),
      window(optimizer, options.accumulate(), options.set_to_none(), options.reduction()),
      guard(options.skip_non_finite(), options.check_gradients()),
      batch_statistics(options.batch_statistics()) {
  counters.micro_batch = whole_batch ? 0 : options.micro_batch().value_or(0);
  counters.eval_batch = options.eval_batch().value_or(0);
}

void StepState::drop_window() {
  window.drop();
  if (grad_ready) {
    grad_ready->clear();
  }
}

PartialStepError StepState::partial_error(const char* where,
                                          const std::vector<torch::Tensor>& changed,
                                          const std::exception& error) {
  auto partial = partial_step_error(
      *module, where, changed, error,
      "the others and the trainer's counters are as before; the window's gradients were "
      "dropped and the step was not retried. The trainer refuses further steps until "
      "accept_partial_update() is called (or a saved state loaded)");
  halt.halt(fmt::format("{} of step {} changed {} parameter(s) before failing", where,
                        counters.steps + 1, partial.updated.size()));
  return partial;
}

}  // namespace frugal::detail
