// A unit's Linear weights made for each of its runs: dequantized from a frozen store, with
// LoRA adapters folded in, or both. One hook a unit, shared by FrozenWeights and Lora.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <vector>

#include "frugal/nn/unit_hook.h"

namespace frugal::nn::detail {

/// One Linear of a unit: what its forward reads as `weight` during a run.
struct LinearSlot {
  torch::nn::LinearImpl* linear = nullptr;
  torch::Tensor param;  ///< the registered parameter `weight`
  /// The base materialised from a store (null: the parameter as it is).
  std::function<torch::Tensor()> stored;
  /// The base with adapters folded in (null: none).
  std::function<torch::Tensor(const torch::Tensor&)> adapt;
  /// The layer is a unit of its own inside this one (LoRA with dropout): a run keeps its
  /// weight in `current`, and the member holds it only inside the layer's own call.
  bool own_call = false;
  torch::Tensor current;
  /// What the member holds where the layer must not run: an empty tensor.
  torch::Tensor no_weight() const { return torch::empty({0}, param.options()); }
};

/// Each run sets every slot's `weight` member (or, for a layer with its own call, `current`)
/// to its value and, after the run, back to an empty tensor (or the parameter, where it is neither
/// stored nor adapted), so a layer called outside its unit fails loudly. What autograd keeps of a
/// call's weights gives its bytes back when the forward ends and takes them again, computed anew,
/// when backward reaches the unit (a gradient of one of its outputs is in); what nothing keeps goes
/// at once.
class UnitWeightsHook : public UnitHook, public std::enable_shared_from_this<UnitWeightsHook> {
 public:
  void before_forward() override;
  void after_forward(const std::vector<torch::Tensor>& outputs) override;
  void enter_run() override;
  void leave_run() override;

  /// The slot of `linear`, made when it has none.
  LinearSlot& slot(torch::nn::LinearImpl* linear);
  /// Drops slots that are neither stored nor adapted (their member back to the parameter);
  /// whether any is left.
  bool prune();

 private:
  torch::Tensor value(const LinearSlot& slot) const;

  std::vector<std::unique_ptr<LinearSlot>> slots_;
  bool in_call_ = false;
  std::vector<std::pair<const LinearSlot*, torch::Tensor>> made_;  // this call's
};

/// A unit and its UnitWeightsHook, as FrozenWeights and Lora keep them.
struct WeightsUnit {
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<UnitWeightsHook> hook;
};

/// An error naming `unit` when it is another kind of unit (an Int8Weights or ZeroOptimizer
/// one); it changes nothing.
void check_weights_unit(const torch::nn::Module& unit);
/// `unit` with its UnitWeightsHook, registered when it has no hook; check_weights_unit's
/// error for another kind of unit.
WeightsUnit unit_weights(const std::shared_ptr<torch::nn::Module>& unit);
/// Unregisters the unit's hook when the hook has no slots left.
void release_unit_weights(const WeightsUnit& unit);

}  // namespace frugal::nn::detail
