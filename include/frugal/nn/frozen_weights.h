// A frozen base's Linear weights stored in 4 (NF4) or 8 bits and made whole one unit at a time.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "frugal/nn/module_pointer.h"

namespace frugal::nn {

namespace detail {
struct FrozenState;
}  // namespace detail

/// How FrozenWeights stores a weight.
enum class FrozenFormat {
  /// QLoRA's 4-bit NormalFloat: blocks of 64, each block's absmax in 8 bits (blocks of 256,
  /// double quantization), as bitsandbytes codes them: about 0.52 bytes a parameter.
  NF4,
  /// frugal's 8-bit weight codes (an unsigned code with a zero point and a scale a group):
  /// about 1.03 bytes a parameter at groups of 128.
  Int8,
};

struct FrozenWeightsOptions {
  TORCH_ARG(FrozenFormat, format) = FrozenFormat::NF4;
  /// The dtype the weights are made whole in while their unit runs; the unit's other
  /// floating-point parameters (norms, biases) are cast to it. torch::kBFloat16 or
  /// torch::kFloat. Unset: the dtype the unit's first Linear weight had when it was added.
  TORCH_ARG(std::optional<torch::Dtype>, dtype) = std::nullopt;
  /// Int8's group size.
  TORCH_ARG(std::int64_t, group) = 128;
};

/// The frozen base of a fine-tune, compact: each `add`ed unit's Linear weights are stored
/// as NF4 or 8-bit codes (buffers beside the weight, `weight_nf4`, `weight_nf4_absmax`,
/// `weight_nf4_absmax2`, `weight_nf4_offset`, or `weight_codes`, `weight_qparams`: the ledger
/// counts them as weights, state dicts carry them) and frozen; the parameter `weight` itself
/// keeps no bytes. Each run of the unit (its forward, a checkpoint's recompute) makes them
/// whole in `dtype`; what autograd keeps of them for backward gives its bytes back until
/// backward reaches the unit. Lora adapters on the same units fold into these weights: QLoRA.
///
/// Adding each block as it is built and loaded keeps a model from ever existing whole in
/// 16 bits: a base loaded from safetensors block by block never holds more than one block
/// in `dtype` beside the codes.
///
/// Example:
///   frugal::nn::FrozenWeights base;  // NF4, made whole in the blocks' dtype (bfloat16)
///   for (int i = 0; i < layers; ++i) {
///     frugal::nn::DefaultDtypeGuard bf16(torch::kBFloat16);
///     auto block = model->add_block();
///     frugal::io::load(*block, checkpoint, ...);  // this block's tensors
///     base.add(block);
///   }
///   frugal::nn::Lora lora(*model, model->blocks(), frugal::nn::LoraOptions().rank(8));
class FrozenWeights {
 public:
  explicit FrozenWeights(FrozenWeightsOptions options = {});
  /// The weights made whole in `dtype` into their parameters, which stay frozen (where
  /// memory allows: past a failed allocation the weights keep their codes in their buffers
  /// and their parameters stay empty).
  ~FrozenWeights();
  FrozenWeights(const FrozenWeights&) = delete;
  FrozenWeights& operator=(const FrozenWeights&) = delete;

  /// Stores every Linear weight of `unit` and freezes the unit's parameters. Refused,
  /// changing nothing, for a unit of an Int8Weights or ZeroOptimizer, or one stored already.
  template <typename Unit>
  Unit add(Unit unit) {
    add_module(module_pointer(unit));
    return unit;
  }
  void add_module(const std::shared_ptr<torch::nn::Module>& unit);

  const FrozenWeightsOptions& options() const { return options_; }
  /// Elements stored, over all units, and the bytes of their codes and statistics.
  std::int64_t stored_elements() const;
  std::int64_t stored_bytes() const;

 private:
  FrozenWeightsOptions options_;
  std::shared_ptr<detail::FrozenState> state_;
};

}  // namespace frugal::nn
