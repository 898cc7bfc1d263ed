// Checkpoints chosen blocks of a model, anywhere in its tree, keeping its parameter names.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "frugal/checkpoint.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/train/policy.h"

namespace frugal {

/// Which modules of the model to checkpoint. A module is chosen when any rule picks it;
/// modules inside a chosen one are not chosen again. Each name and type given must match
/// some module, and `every` some child, or the policy refuses the model (a misspelt rule
/// is an error, not a silent no-op).
struct CheckpointSelect {
  /// Qualified names, as in named_modules(): "3", "blocks.3", "encoder.layers.0".
  TORCH_ARG(std::vector<std::string>, names) = {};
  /// Module type names, as Module::name() gives them, with or without "Impl" and namespace:
  /// "ResidualBlock", "torch::nn::TransformerEncoderLayer".
  TORCH_ARG(std::vector<std::string>, types) = {};
  /// Every N-th child of each Sequential and ModuleList (1: all of them; 0: this rule is off).
  TORCH_ARG(std::int64_t, every) = 0;
};

/// Checkpoints the chosen modules of a model, found anywhere in its tree (members,
/// Sequential, ModuleList, ModuleDict, nested), without renaming anything: parameter and
/// buffer names, the tensors and state dicts are the same with and without the policy.
///
/// C++ calls a member's forward directly, so how a chosen module's calls are reached
/// depends on who calls it:
/// - a child of a torch::nn::Sequential: the Sequential's call goes through a checkpoint
///   (forward of one Tensor, as Sequential chains them); nothing to change in the model;
/// - any other module (a member, a ModuleList or ModuleDict entry), with any forward
///   signature: its parent calls it as `frugal::nn::call(block, x, mask, ...)` instead of
///   `block->forward(x, mask, ...)`; that call checkpoints it when a policy chose it and
///   gradients are recorded, and is a plain forward otherwise.
/// A chosen module that the first training forward did not reach so is an error naming it.
/// Under no_grad (evaluation) blocks run plainly.
///
/// Example:
///   // in the model: for (auto& layer : *layers) x = frugal::nn::call(layer->as<Block>(), x,
///   mask); trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
///       frugal::CheckpointSelect().types({"Block"})));
class CheckpointPolicy : public Policy {
 public:
  explicit CheckpointPolicy(CheckpointSelect select, CheckpointOptions options = {});
  ~CheckpointPolicy() override;
  std::string name() const override { return "checkpoint"; }
  void on_add(PolicyPort& port) override;
  void on_step_begin(StepContext& ctx) override;
  /// After the first training forward: checks that every chosen module was reached.
  void after_forward(StepContext& ctx) override;

  /// Chooses the modules of `root` (once) and returns their qualified names; an error when
  /// a rule matches nothing.
  const std::vector<std::string>& apply(torch::nn::Module& root);
  /// Turns all chosen blocks' checkpointing off (plain forward) or on.
  void set_enabled(bool enabled);
  /// Turns one chosen block's checkpointing off or on, by its qualified name as wrapped()
  /// lists it; an error naming it when the policy did not choose it.
  void set_enabled(const std::string& block, bool enabled);
  /// Whether a chosen block is checkpointed now; an error naming it when not chosen.
  bool enabled(const std::string& block) const;
  const std::vector<std::string>& wrapped() const { return chosen_names_; }

 private:
  struct Chosen;
  void choose(const std::string& qualified, const std::shared_ptr<torch::nn::Module>& module,
              torch::nn::Module* parent, std::size_t index);

  CheckpointSelect select_;
  CheckpointOptions options_;
  bool applied_ = false;
  bool checked_ = false;
  std::vector<std::string> chosen_names_;
  std::vector<std::pair<std::string, nn::Checkpoint>> wrappers_;  // Sequential slots
  std::vector<std::shared_ptr<Chosen>> by_call_;  // reached through frugal::nn::call
};

}  // namespace frugal
