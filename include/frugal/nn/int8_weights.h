// Weights stored in 8 bits between uses and materialised in 16 bits one unit at a time.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "frugal/nn/module_pointer.h"

namespace frugal::nn {

struct Int8WeightsOptions {
  /// Consecutive elements that share a zero point and a scale: 128 costs 4 bytes a group
  /// beside the codes, 1.03 bytes a parameter.
  TORCH_ARG(std::int64_t, group) = 128;
  /// The dtype a unit's stored weights are materialised in while it runs; its other
  /// floating-point parameters (norms, biases, small tensors) are cast to it and stay so.
  /// torch::kBFloat16 or torch::kFloat32. Unset: the dtype the unit's weights had when it
  /// was added (its first stored matrix's), so a float32 model runs in float32 and one
  /// built in bfloat16 in bfloat16.
  TORCH_ARG(std::optional<torch::Dtype>, dtype) = std::nullopt;
  /// Parameters of at least two dimensions and this many elements are stored in 8 bits;
  /// the others stay in `dtype`.
  TORCH_ARG(std::int64_t, min_elements) = 4096;
};

namespace detail {
struct Int8State;
}  // namespace detail

/// LibTorch's default dtype set to `dtype` while this lives (and restored after): modules
/// made meanwhile get parameters of that dtype. A block made under
/// DefaultDtypeGuard(torch::kBFloat16) to be added to an Int8Weights exists, for a moment,
/// in 2 bytes a parameter instead of 4.
class DefaultDtypeGuard {
 public:
  explicit DefaultDtypeGuard(torch::Dtype dtype);
  ~DefaultDtypeGuard();
  DefaultDtypeGuard(const DefaultDtypeGuard&) = delete;
  DefaultDtypeGuard& operator=(const DefaultDtypeGuard&) = delete;

 private:
  caffe2::TypeMeta before_;
};

/// A model's matrices stored as 8-bit codes, per group of `group` elements an unsigned code
/// each with a zero point and a scale (Q-GaLore's weights), about 1.03 bytes a parameter
/// instead of 2 (bfloat16) or 4. The codes live in buffers of the module that owns the
/// parameter (`<name>_codes`, `<name>_qparams`): the ledger counts them as weights, and the
/// model's state dict, torch::save and frugal's training state save and load them.
///
/// Each unit `add`ed (a block reached through frugal::nn::call) is materialised in `dtype`
/// (by default the dtype its weights had when added)
/// when its forward begins and released when it ends; backward materialises it again
/// before its own backward (and a checkpoint's recompute) and releases it once every stored
/// parameter has its gradient. Between uses its stored parameters are empty tensors (the
/// same objects, names and hooks): reading them outside a call fails loudly; read them
/// inside an Int8Weights::Materialised.
///
/// frugal's optimizers (SGD, Adam, AdamW, Adam8bit, AdamW8bit and their 4-bit and factored
/// states) update the codes directly: each group is decoded to float32, updated and encoded
/// again with fresh statistics, rounded as InPlaceOptions::rounding says: Stochastic (the
/// default; small updates survive in expectation, with saved random bits so that a resumed
/// run is bit-exact) or Nearest. With the step in backward (frugal::StepInBackward), a
/// unit's gradients go as soon as it is updated, so at most the units in flight hold 16-bit
/// weights and gradients.
///
/// The model never needs to exist whole in a wider dtype: build it unit by unit, adding each
/// block as it is made (under a DefaultDtypeGuard of bfloat16, so that one block exists in
/// 16 bits for a moment); its weights go as soon as it is stored.
///
/// Example:
///   frugal::nn::Int8Weights int8;
///   for (int i = 0; i < layers; ++i) {
///     frugal::nn::DefaultDtypeGuard bf16(torch::kBFloat16);
///     blocks->push_back(int8.add(Block(dim)));  // stored in 8 bits at once
///   }
///   ... x = frugal::nn::call(blocks->ptr<BlockImpl>(i), x);  in the model's forward
class Int8Weights {
 public:
  explicit Int8Weights(Int8WeightsOptions options = {});
  /// The units' weights are materialised in `dtype` and stay so: the model is an ordinary
  /// one again.
  ~Int8Weights();
  Int8Weights(const Int8Weights&) = delete;
  Int8Weights& operator=(const Int8Weights&) = delete;

  /// Stores `unit`'s matrices in 8 bits (rounded to nearest), casts its other floating-point
  /// parameters to `dtype`, and makes it a unit. Returns `unit`. Refused, changing nothing,
  /// for a module that is a unit already or shares a parameter with one.
  template <typename Unit>
  Unit add(Unit unit) {
    add_module(module_pointer(unit));
    return unit;
  }
  void add_module(const std::shared_ptr<torch::nn::Module>& unit);

  /// The parameters of `unit` that `add` would store in 8 bits under `options` (its
  /// floating-point matrices of at least min_elements), each once.
  static std::vector<torch::Tensor> storable(torch::nn::Module& unit,
                                             const Int8WeightsOptions& options);
  /// Bytes of the codes and group statistics of a parameter of `elements` in groups of `group`.
  static std::int64_t stored_bytes(std::int64_t elements, std::int64_t group);

  const Int8WeightsOptions& options() const { return options_; }
  /// Elements stored in 8 bits, over all units.
  std::int64_t stored_elements() const;
  /// Bytes of their codes and group statistics.
  std::int64_t stored_bytes() const;
  /// Bytes of stored weights materialised in `dtype` now.
  std::int64_t materialised_bytes() const;

  /// Every unit materialised while this lives (to evaluate outside frugal::nn::call, read
  /// or export the weights); units called meanwhile stay whole.
  class Materialised {
   public:
    explicit Materialised(Int8Weights& weights);
    ~Materialised();
    Materialised(const Materialised&) = delete;
    Materialised& operator=(const Materialised&) = delete;

   private:
    void unpin();
    std::shared_ptr<detail::Int8State> state_;
  };

 private:
  Int8WeightsOptions options_;
  std::shared_ptr<detail::Int8State> state_;
};

}  // namespace frugal::nn
