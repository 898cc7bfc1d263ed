// What acts on a unit (a module reached through frugal::nn::call) around each of its calls.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

namespace frugal::nn {

/// Work done around every frugal::nn::call of one module, e.g. gathering its parameters
/// before the forward and releasing them after (ZeRO-3 units). One hook a module; the
/// code that registers it removes it when it goes.
class UnitHook {
 public:
  virtual ~UnitHook() = default;
  /// Before the module's forward (and before a checkpoint of it).
  virtual void before_forward() = 0;
  /// After the forward, with the call's Tensor outputs (none when it returned another
  /// type: then backward cannot be reached through them); the hook may attach gradient
  /// hooks to them.
  virtual void after_forward(const std::vector<torch::Tensor>& outputs) = 0;
  /// Around each run of the module's forward, inside the unit: the call's, and a checkpoint's
  /// recompute of it in backward. For work every run needs anew (adapters folded into a
  /// weight the forward reads).
  virtual void enter_run() {}
  virtual void leave_run() {}
  /// For a call of one Tensor that returns one Tensor, inside each run after the module's
  /// forward: what the call returns for input `in` when the forward gave `out` (LoRA's
  /// adapters on a dropped-out input). A checkpoint's recompute runs it again under the
  /// forward's random state. Default: `out`.
  virtual torch::Tensor run_output(const torch::Tensor& /*in*/, const torch::Tensor& out) {
    return out;
  }
};

/// The hook registered for `module`, or null.
std::shared_ptr<UnitHook> unit_hook(const torch::nn::Module& module);

namespace detail {

/// The registry of unit hooks (thread-safe); an error when `module` has one already.
void add_unit_hook(const torch::nn::Module* module, std::shared_ptr<UnitHook> hook);
void remove_unit_hook(const torch::nn::Module* module);

/// Calls `hook`'s enter_run now and its leave_run when it goes (also when the forward
/// throws); nothing for a null hook.
class UnitRun {
 public:
  explicit UnitRun(UnitHook* hook) : hook_(hook) {
    if (hook_ != nullptr) {
      hook_->enter_run();
    }
  }
  ~UnitRun() {
    if (hook_ != nullptr) {
      hook_->leave_run();
    }
  }
  UnitRun(const UnitRun&) = delete;
  UnitRun& operator=(const UnitRun&) = delete;

 private:
  UnitHook* hook_;
};

/// A run's result: `hook`'s run_output for a call of one Tensor to one Tensor, `out` as it
/// is otherwise.
template <typename Out, typename... Args>
Out finish_run(UnitHook* hook, Out out, const Args&... args) {
  if constexpr (std::is_same_v<Out, torch::Tensor> && sizeof...(Args) == 1 &&
                (std::is_same_v<Args, torch::Tensor> && ...)) {
    if (hook != nullptr) {
      return hook->run_output(args..., out);
    }
  }
  return out;
}

/// A call's Tensor outputs, for UnitHook::after_forward.
inline std::vector<torch::Tensor> unit_outputs(const torch::Tensor& out) { return {out}; }
inline std::vector<torch::Tensor> unit_outputs(const std::vector<torch::Tensor>& out) {
  return out;
}
/// A tuple's Tensor elements (MultiheadAttention's output and weights).
template <typename... T>
std::vector<torch::Tensor> unit_outputs(const std::tuple<T...>& out) {
  std::vector<torch::Tensor> tensors;
  std::apply(
      [&tensors](const auto&... element) {
        (
            [&tensors](const auto& e) {
              if constexpr (std::is_same_v<std::decay_t<decltype(e)>, torch::Tensor>) {
                tensors.push_back(e);
              }
            }(element),
            ...);
      },
      out);
  return tensors;
}
template <typename T>
std::vector<torch::Tensor> unit_outputs(const T& /*out*/) {
  return {};
}

}  // namespace detail
}  // namespace frugal::nn
