// Checkpoints chosen blocks of a model without editing the model's code.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "frugal/checkpoint.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/train/policy.h"

namespace frugal {

/// Which children of the model's Sequential containers to checkpoint. A child is chosen
/// when any rule picks it.
struct CheckpointSelect {
  /// Qualified names of children, as in named_modules(): "3", "blocks.3".
  TORCH_ARG(std::vector<std::string>, names) = {};
  /// Module type names, as Module::name() gives them, with or without "Impl" and namespace:
  /// "ResidualBlock", "torch::nn::Linear".
  TORCH_ARG(std::vector<std::string>, types) = {};
  /// Every N-th child of each Sequential (1: all of them; 0: this rule is off).
  TORCH_ARG(std::int64_t, every) = 0;
};

/// Wraps the chosen children of every Sequential in the model (anywhere in its tree) in
/// frugal::nn::Checkpoint, in place, at the first step (or when `apply` is called). Wrapped
/// parameters get the prefix "module." in their names; the tensors stay the same, so an
/// optimizer built before keeps working. Under no_grad (evaluation) blocks run plainly.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
///       frugal::CheckpointSelect().types({"ResidualBlock"})));
class CheckpointPolicy : public Policy {
 public:
  explicit CheckpointPolicy(CheckpointSelect select, CheckpointOptions options = {});
  std::string name() const override { return "checkpoint"; }
  /// Wraps the blocks when added, so that the module's names are final before a saved
  /// training state is loaded into it.
  void on_add(Trainer& trainer) override;
  void on_step_begin(StepContext& ctx) override;

  /// Wraps the chosen children of `root` (once); returns their qualified names.
  const std::vector<std::string>& apply(torch::nn::Module& root);
  /// Turns all wrapped blocks' checkpointing off (plain forward) or on.
  void set_enabled(bool enabled);
  const std::vector<std::string>& wrapped() const { return wrapped_names_; }

 private:
  bool chosen(const std::string& qualified, std::size_t index,
              const torch::nn::Module& child) const;

  CheckpointSelect select_;
  CheckpointOptions options_;
  bool applied_ = false;
  std::vector<std::string> wrapped_names_;
  std::vector<nn::Checkpoint> wrappers_;
};

}  // namespace frugal
