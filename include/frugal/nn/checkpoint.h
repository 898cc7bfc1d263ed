// A module wrapper that checkpoints the module it holds.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include "frugal/checkpoint.h"

namespace frugal::nn {

/// Runs the wrapped module under frugal::checkpoint when gradients are being recorded,
/// and plainly otherwise (under no_grad nothing is saved, so nothing needs recomputing).
/// The wrapped module's forward takes and returns one Tensor; it is registered as the
/// child "module", so its parameters are the wrapper's.
///
/// Example:
///   torch::nn::Sequential net(frugal::nn::Checkpoint(Block(512, 2048)),
///                             frugal::nn::Checkpoint(Block(512, 2048)));
class CheckpointImpl : public torch::nn::Module {
 public:
  template <typename ModuleHolder>
  explicit CheckpointImpl(ModuleHolder module, CheckpointOptions options = {})
      : CheckpointImpl(torch::nn::AnyModule(module), std::move(options)) {}
  explicit CheckpointImpl(torch::nn::AnyModule module, CheckpointOptions options = {});

  torch::Tensor forward(const torch::Tensor& input);

  /// Turns checkpointing off (a plain forward) or on again.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }
  torch::nn::AnyModule& wrapped() { return module_; }

 private:
  torch::nn::AnyModule module_;
  CheckpointOptions options_;
  bool enabled_ = true;
};

TORCH_MODULE(Checkpoint);

}  // namespace frugal::nn
