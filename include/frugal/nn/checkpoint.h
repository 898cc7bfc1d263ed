// A module wrapper that checkpoints the module it holds.
#pragma once

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>

#include "frugal/checkpoint.h"
#include "frugal/memory/memory_context.h"
#include "frugal/nn/module_pointer.h"
#include "frugal/nn/unit_hook.h"

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

/// How a policy chose to checkpoint `module` (counting the call), or null when none chose
/// it or its checkpointing is off: what frugal::nn::call asks.
std::shared_ptr<const CheckpointOptions> checkpoint_choice(const torch::nn::Module& module);

namespace detail {

template <typename Block, typename... Args>
auto call_checkpointed(const std::shared_ptr<Block>& ptr, const std::shared_ptr<UnitHook>& hook,
                       const Args&... args) {
  std::shared_ptr<const CheckpointOptions> chosen;
  if (at::GradMode::is_enabled()) {
    chosen = checkpoint_choice(*ptr);
  }
  if (chosen == nullptr) {
    frugal::detail::UnitScope unit(ptr.get());
    UnitRun run(hook.get());
    return finish_run(hook.get(), ptr->forward(args...), args...);
  }
  return checkpoint(
      [ptr, hook](const auto&... a) {
        frugal::detail::UnitScope unit(
            ptr.get());  // the recompute in backward runs inside the unit too
        UnitRun run(hook.get());
        return finish_run(hook.get(), ptr->forward(a...), a...);
      },
      CheckpointOptions(*chosen).params(ptr->parameters()).buffers(training_buffers(*ptr)),
      args...);
}

}  // namespace detail

/// Calls `block->forward(args...)`, checkpointed when a CheckpointPolicy chose `block` and
/// gradients are being recorded (Tensor arguments are the checkpoint's inputs, other
/// arguments pass through; the block's parameters always get gradients). A plain forward
/// otherwise. `block` is a module holder (Linear, a TORCH_MODULE) or a shared_ptr to a
/// module, e.g. from ModuleList's `ptr<BlockImpl>(i)`. A UnitHook registered for `block`
/// (a ZeRO-3 unit's parameter gathering) runs around the call.
///
/// Example:
///   torch::Tensor forward(torch::Tensor x, torch::Tensor mask) {
///     for (std::size_t i = 0; i < blocks->size(); ++i) {
///       x = frugal::nn::call(blocks->ptr<BlockImpl>(i), x, mask);
///     }
///     return head(x);
///   }
template <typename Block, typename... Args>
auto call(const Block& block, const Args&... args) {
  auto ptr = module_pointer(block);
  const auto hook = unit_hook(*ptr);
  if (hook == nullptr) {
    return detail::call_checkpointed(ptr, hook, args...);
  }
  hook->before_forward();
  auto out = detail::call_checkpointed(ptr, hook, args...);
  hook->after_forward(detail::unit_outputs(out));
  return out;
}

}  // namespace frugal::nn
