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
  /// With Trait::KeepsGradients: a step's gradients begin to arrive (called once a step,
  /// before its first keep_gradient); `will_step` is false when the step will be skipped
  /// (some process's loss was NaN or infinite). With Trait::UpdatesSharesInBackward the
  /// optimizer updates each share as its gradients are all kept, during backward, and
  /// only when `will_step`.
  virtual void begin_gradients(bool will_step) { (void)will_step; }
  /// With Trait::ShardsParameters: puts the whole parameters back from every process's
  /// share before a forward (collective: every process calls it), if they are released.
  virtual void gather_parameters() {}
  /// With Trait::ShardsParameters: what a forward needs whole before it starts (all the
  /// parameters, or those outside units that gather themselves); collective.
  virtual void gather_for_forward() { gather_parameters(); }
  /// With Trait::ShardsParameters: frees the whole parameters again (each keeps its share).
  virtual void release_parameters() {}
  /// Whether the parameters are whole now (always, without Trait::ShardsParameters).
  virtual bool parameters_whole() const { return true; }
  /// The elements `param` holds when whole, released or not.
  virtual std::int64_t whole_numel(const torch::Tensor& param) const { return param.numel(); }
};

/// The whole parameters of a ShardedOptimizer for as long as it lives, to evaluate, read or
/// save the model between steps (DeepSpeed's GatheredParameters): gathers them if they were
/// released, and releases them again at its end. Collective: every process makes one.
///
/// Example:
///   { frugal::optim::GatheredParameters whole(zero);  torch::save(model, "model.pt"); }
class GatheredParameters {
 public:
  /// Whole: every parameter. ForForward: what a forward needs before it starts
  /// (ShardedOptimizer::gather_for_forward); Trainer::evaluate gathers so, and units gather
  /// themselves one at a time as the forward calls them.
  enum class What { Whole, ForForward };
  explicit GatheredParameters(ShardedOptimizer& optimizer, What what = What::Whole)
      : optimizer_(optimizer), gathered_(!optimizer.parameters_whole()) {
    if (gathered_ && what == What::ForForward) {
      optimizer_.gather_for_forward();
    } else if (gathered_) {
      optimizer_.gather_parameters();
    }
  }
  ~GatheredParameters() {
    if (gathered_) {
      optimizer_.release_parameters();
    }
  }
  GatheredParameters(const GatheredParameters&) = delete;
  GatheredParameters& operator=(const GatheredParameters&) = delete;

 private:
  ShardedOptimizer& optimizer_;
  bool gathered_;
};

}  // namespace frugal::optim
