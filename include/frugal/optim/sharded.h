// What an optimizer sharded over processes tells the engine, data parallelism and fit.
#pragma once

#include <torch/types.h>

#include "frugal/traits.h"

namespace frugal::optim {

/// An optimizer whose state is split among processes, each keeping its share (ZeRO's):
/// the trainer reads its traits beside its policies' (Trait::KeepsGradients refuses
/// policies that read every gradient), data parallelism hands it the gradients it keeps, and
/// fit saves each process's state apart. Ask for it through this interface, never by the
/// optimizer's class.
class ShardedOptimizer {
 public:
  virtual ~ShardedOptimizer() = default;
  /// Trait::KeepsGradients when each process keeps only its share of the gradients, so
  /// that the parameters hold none at the optimizer step; else none.
  virtual Traits traits() const = 0;
  /// With Trait::KeepsGradients: `grad` is `param`'s averaged gradient, flat; the
  /// optimizer keeps the part this process owns. Called once per parameter and step.
  virtual void keep_gradient(const torch::Tensor& param, const torch::Tensor& grad) = 0;
};

}  // namespace frugal::optim
