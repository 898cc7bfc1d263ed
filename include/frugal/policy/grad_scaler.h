// Loss scaling for fp16 training: torch.amp.GradScaler's semantics, for LibTorch C++.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "frugal/train/policy.h"

namespace frugal {

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;   ///< > 1
  TORCH_ARG(double, backoff_factor) = 0.5;  ///< in (0, 1)
  TORCH_ARG(std::int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
};

/// Multiplies the loss by a scale so fp16 gradients do not underflow, unscales gradients
/// before the optimizer step, skips the step when any gradient is inf or NaN, and adapts the
/// scale: backoff on inf/NaN, growth after `growth_interval` clean steps in a row.
/// The scale lives on the device of the first loss it scales, created then (lazily).
/// Uses LibTorch's fused kernels where the build has them for the device, and tensor ops
/// with the same results where it has not (the CPU in LibTorch 1.13).
/// A disabled scaler is a no-op with scale 1.
///
/// Example:
///   frugal::GradScaler scaler;
///   scaler.scale(loss).backward();
///   scaler.unscale_(optimizer);                 // optional: clip true gradients
///   torch::nn::utils::clip_grad_norm_(params, 1.0);
///   scaler.step(optimizer);                     // skipped on inf/NaN
///   scaler.update();
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  torch::Tensor scale(const torch::Tensor& loss);
  /// Divides the optimizer's gradients by the scale, once per step (twice is an error),
  /// and records whether any was inf or NaN.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// Unscales if not done yet, then steps the optimizer unless a gradient was inf/NaN.
  /// Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  /// Adapts the scale from this step's findings (or sets `new_scale`) and readies the
  /// scaler for the next step.
  void update(c10::optional<double> new_scale = c10::nullopt);

  /// For engines that run the optimizer themselves: unscales if needed, marks the
  /// optimizer stepped and returns whether its step should run.
  bool prepare_step(torch::optim::Optimizer& optimizer);
  bool unscaled(const torch::optim::Optimizer& optimizer) const;
  /// Forgets the unscale and inf checks recorded for `optimizer` since the last update(),
  /// as if its step had not begun: for a step that failed before it was applied.
  void discard_step(const torch::optim::Optimizer& optimizer);

  double get_scale() const;
  std::int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled(); }
  const GradScalerOptions& options() const { return options_; }

  /// {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"},
  /// empty when disabled (as torch.amp.GradScaler.state_dict).
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct PerOptimizer {
    Stage stage = Stage::Ready;
    std::vector<torch::Tensor> found_inf;  // one per device of the gradients
  };
  void lazy_init(torch::Device device);
  bool found_inf(const PerOptimizer& state) const;

  GradScalerOptions options_;
  torch::Tensor scale_;           // float32 scalar on the loss's device
  torch::Tensor growth_tracker_;  // int32 scalar beside it
  std::int64_t init_tracker_ = 0;
  std::map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

/// The GradScaler as a policy: scales each micro-batch loss before backward, unscales and
/// decides the skip before the optimizer step, updates after it, and reports the scale.
///
/// Example:
///   auto scaler = std::make_shared<frugal::GradScaler>();
///   trainer.add_policy(std::make_shared<frugal::GradScalerPolicy>(scaler));
class GradScalerPolicy : public Policy {
 public:
  explicit GradScalerPolicy(std::shared_ptr<GradScaler> scaler);
  std::string name() const override { return "grad-scaler"; }
  /// Reads every gradient before any parameter changes and decides the skip on inf/NaN
  /// itself; offers its unscale to other policies through the port.
  Traits traits() const override { return Trait::AllGradients | Trait::OwnsNonFinite; }
  void on_add(PolicyPort& port) override;
  void before_backward(StepContext& ctx) override;
  void before_optimizer_step(StepContext& ctx) override;
  void after_optimizer_step(StepContext& ctx) override;
  void on_optimizer_error(StepContext& ctx, const std::exception& error) override;
  void on_step_end(StepContext& ctx) override;
  /// The scaler's state_dict (scale, growth tracker and options).
  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_state(torch::serialize::InputArchive& archive) override;
  GradScaler& scaler() { return *scaler_; }

 private:
  std::shared_ptr<GradScaler> scaler_;
};

}  // namespace frugal
