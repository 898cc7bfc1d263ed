#include "frugal/policy/oom_recovery.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include "../engine/oom_backoff.h"
#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"
#include "frugal/memory/ledger.h"
#include "frugal/optim/in_place.h"
#include "frugal/state/archive.h"

namespace frugal {
OomRecovery::OomRecovery(OomRecoveryOptions options) : options_(options) {
  FRUGAL_CHECK(options_.min_micro_batch() >= 1,
               "frugal: OomRecovery min_micro_batch must be "
               ">= 1, got ",
               options_.min_micro_batch());
  detail::check_at_least(options_.grow_after(), 0, "OomRecovery grow_after");
}

bool OomRecovery::on_step_error(StepContext& ctx, const std::exception& error) {
  if (!detail::is_out_of_memory(error)) {
    return false;
  }
  port_ = &ctx.port;
  const std::int64_t current = ctx.report.micro_batch;
  const auto next = detail::back_off(current, options_.min_micro_batch(), ctx.probe, error,
                                     "The model and optimizer are as before the step.");
  if (largest_ == 0) {
    largest_ = current;
  }
  ctx.port.set_micro_batch(next);
  clean_steps_ = 0;
  ++recovered_;
  return true;
}

bool OomRecovery::on_eval_error(PolicyPort& port, std::int64_t batch_size,
                                const std::exception& error) {
  if (!detail::is_out_of_memory(error)) {
    return false;
  }
  TORCH_CHECK_WITH(OutOfMemoryError, batch_size > 1,
                   "frugal: out of memory in evaluate() at batch size 1: ",
                   detail::memory_figures(port.probe()), ". The error was: ", error_message(error));
  port.probe().empty_cache();
  port.set_eval_batch(batch_size / 2);
  ++recovered_;
  return true;
}

void OomRecovery::on_optimizer_error(StepContext& ctx, const std::exception& error) {
  if (!detail::is_out_of_memory(error)) {
    return;
  }
  const auto ledger = measure_ledger(ctx.probe, ctx.module, &ctx.optimizer);
  std::string need;
  const auto stats = CountingAllocator::stats();
  if (ctx.probe.device().is_cpu() && stats.cap > 0 && stats.last_refused > 0) {
    need = fmt::format("; it asked for {} more with {} allocated under a cap of {}",
                       format_bytes(stats.last_refused), format_bytes(ledger.allocated),
                       format_bytes(stats.cap));
  }
  const bool in_place = dynamic_cast<optim::InPlaceOptimizer*>(&ctx.optimizer) != nullptr;
  ctx.probe.empty_cache();
  TORCH_CHECK_WITH(
      OutOfMemoryError, false,
      fmt::format("frugal: out of memory in the optimizer step (step {}){}. Between steps the "
                  "model holds weights {}, gradients {}, optimizer state {}; a smaller "
                  "micro-batch cannot lower this phase, so the step was not retried. "
                  "Parameters, optimizer state and the trainer's counters are as before the "
                  "step (the window's gradients were dropped). What fits in less: {}more "
                  "memory. The error was: {}",
                  ctx.port.steps() + 1, need, format_bytes(ledger.weights),
                  format_bytes(ledger.gradients), format_bytes(ledger.optimizer),
                  in_place ? "frugal::StepInBackward (frees each gradient as it is used), or "
                           : "one of frugal::optim's optimizers (they update in place with one "
                             "chunk of scratch), frugal::StepInBackward, or ",
                  error_message(error)));
}

void OomRecovery::on_step_end(StepContext& ctx) {
  if (ctx.report.oom_retries > 0 || options_.grow_after() == 0 || port_ == nullptr) {
    return;
  }
  if (++clean_steps_ >= options_.grow_after() && port_->micro_batch() < largest_) {
    port_->set_micro_batch(std::min(largest_, port_->micro_batch() * 2));
    clean_steps_ = 0;
  }
}

void OomRecovery::save_state(torch::serialize::OutputArchive& archive) const {
  state::write_int(archive, "largest", largest_);
  state::write_int(archive, "clean_steps", clean_steps_);
  state::write_int(archive, "recovered", recovered_);
}

void OomRecovery::load_state(torch::serialize::InputArchive& archive) {
  const auto largest = state::read_int(archive, "largest");
  const auto clean_steps = state::read_int(archive, "clean_steps");
  const auto recovered = state::read_int(archive, "recovered");
  FRUGAL_CHECK(largest >= 0 && clean_steps >= 0 && recovered >= 0,
               "frugal: invalid saved OomRecovery state: largest ", largest, ", clean_steps ",
               clean_steps, ", recovered ", recovered);
  largest_ = largest;
  clean_steps_ = clean_steps;
  recovered_ = recovered;
}

}  // namespace frugal
