// What a policy may use of the engine that runs it.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>

#include "frugal/memory/probe.h"

namespace frugal {

/// What a policy may use of the trainer that runs it, beyond the step in flight: the module,
/// the optimizer, the probe, the micro-batch and evaluation batch sizes (a policy may change
/// them), the step counters, and the loss scale the gradients carry. Policies receive it
/// (Policy::on_add, Policy::on_eval_error, StepContext::port), never the trainer itself, and
/// never each other: what one policy offers another goes through here.
///
/// Example:
///   struct HalveOnError : frugal::Policy {
///     std::string name() const override { return "halve-on-error"; }
///     frugal::Traits traits() const override { return frugal::Trait::Retries; }
///     bool on_step_error(frugal::StepContext& c, const std::exception&) override {
///       c.port.set_micro_batch(std::max<std::int64_t>(1, c.report.micro_batch / 2));
///       return c.report.micro_batch > 1;
///     }
///   };
class PolicyPort {
 public:
  virtual torch::nn::Module& module() = 0;
  virtual torch::optim::Optimizer& optimizer() = 0;
  virtual const MemoryProbe& probe() const = 0;
  /// The micro-batch size in use (0: the whole batch).
  virtual std::int64_t micro_batch() const = 0;
  virtual void set_micro_batch(std::int64_t size) = 0;
  /// The evaluation batch size in use (0: the micro-batch, else the whole set).
  virtual std::int64_t eval_batch() const = 0;
  virtual void set_eval_batch(std::int64_t size) = 0;
  /// Optimizer steps taken, and of those skipped (inf/NaN).
  virtual std::int64_t steps() const = 0;
  virtual std::int64_t skipped_steps() const = 0;

  /// How a policy that scales the loss (GradScalerPolicy) divides its scale out of the
  /// optimizer's gradients, once per step whoever asks first.
  using Unscale = std::function<void(torch::optim::Optimizer&)>;
  virtual void set_unscale(Unscale unscale) = 0;
  /// Divides the loss scale out of the gradients if a policy scales them (and has not
  /// done so this step); nothing otherwise. A policy that needs the true gradients before
  /// the optimizer step (ClipGrad) calls it first.
  virtual void unscale_gradients() = 0;

 protected:
  ~PolicyPort() = default;
};

}  // namespace frugal
