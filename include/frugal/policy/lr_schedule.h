// Learning-rate schedules by optimizer step: warm-up, then constant, linear, cosine or step decay.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

#include "frugal/train/policy.h"

namespace frugal {

enum class LrDecay { Constant, Linear, Cosine, Step };

/// The schedule of the learning rate as a factor of each param group's base rate, by the
/// number t of optimizer steps taken before the one it sets (t = 0 for the first step):
///   warm-up (t < warmup_steps):   (t + 1) / warmup_steps
///   then, with s = t - warmup_steps and n = total_steps - warmup_steps:
///   Constant: 1
///   Linear:   1 - (1 - min_factor) * min(s / n, 1)
///   Cosine:   min_factor + (1 - min_factor) * (1 + cos(pi * min(s / n, 1))) / 2
///   Step:     gamma ^ floor(s / step_size)   (torch.optim.lr_scheduler.StepLR's rule)
struct LrScheduleOptions {
  TORCH_ARG(LrDecay, decay) = LrDecay::Constant;
  TORCH_ARG(std::int64_t, warmup_steps) = 0;
  /// Linear and Cosine: the step at which the factor reaches min_factor (> warmup_steps).
  TORCH_ARG(std::int64_t, total_steps) = 0;
  TORCH_ARG(double, min_factor) = 0.0;
  /// Step: the factor is multiplied by gamma every step_size steps.
  TORCH_ARG(std::int64_t, step_size) = 1;
  TORCH_ARG(double, gamma) = 0.1;
};

/// The factor of the base learning rate for the step after `t` steps (see LrScheduleOptions).
double lr_factor(const LrScheduleOptions& options, std::int64_t t);

/// Sets every param group's learning rate before each optimizer step to its base rate (the
/// rate it had when the policy was added) times lr_factor(steps taken). The position is the
/// trainer's step count, so a resumed run (frugal::load_training_state, which also restores
/// the base rates) goes on where it stopped. Works with the optimizer step in backward too.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::LrSchedule>(
///       frugal::LrScheduleOptions().decay(frugal::LrDecay::Cosine).warmup_steps(100)
///           .total_steps(10000)));
class LrSchedule : public Policy {
 public:
  explicit LrSchedule(LrScheduleOptions options);
  std::string name() const override { return "lr-schedule"; }
  void on_add(PolicyPort& port) override;
  void on_step_begin(StepContext& ctx) override;
  void save_state(torch::serialize::OutputArchive& archive) const override;
  void load_state(torch::serialize::InputArchive& archive) override;

  const LrScheduleOptions& options() const { return options_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }

 private:
  LrScheduleOptions options_;
  const PolicyPort* port_ = nullptr;  // the step counter it follows
  std::vector<double> base_lrs_;
};

}  // namespace frugal
