// What data parallelism does to a model's gradients before its step, as both faces ask it.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>

namespace frugal {

/// What one process brings to a step's agreement: the count its gradients are the mean over
/// (samples, tokens, or 1 for equal shares) and whether one of its losses was NaN or infinite.
struct ReduceShare {
  std::int64_t count = 1;
  bool non_finite = false;
};

/// What the processes agreed on when a step's gradients were all reduced.
struct ReduceResult {
  std::int64_t global_count = 0;  ///< the processes' counts summed
  bool non_finite = false;        ///< some process's loss was NaN or infinite: skip the step
};

/// One model's reducer, in flashlight's shape: `add` each parameter as its gradient is final
/// (from a gradient-ready hook, during backward, so the reduction overlaps it), `finalize`
/// before the optimizer step, which sends what is left, waits, and returns the agreement.
/// After finalize every process holds the same gradients: the count-weighted mean of the
/// processes' (or, under an optimizer that keeps only its share, that share of them).
class ModelReducer {
 public:
  virtual ~ModelReducer() = default;
  /// A step begins: the parameters a forward needs are whole, the buffers every process's.
  virtual void begin() = 0;
  /// `param`'s gradient is final for this step; collective in the order of the buckets.
  virtual void add(const torch::Tensor& param, const ReduceShare& share) = 0;
  /// Reduces every gradient not added yet and waits for all; collective.
  virtual ReduceResult finalize(const ReduceShare& share) = 0;
  /// Whether the optimizer keeps only its share of the gradients (ZeRO stage 2 and 3): the
  /// parameters hold none after finalize, and a second reduction in one step is refused.
  virtual bool keeps_gradients() const = 0;
  /// Whether the processes agree on a non-finite loss during backward, as the first
  /// gradients leave (so `add`'s share must say it); otherwise in finalize alone.
  virtual bool agrees_in_backward() const { return true; }
  /// The loss a process reports for the iteration: the processes' mean of their `loss`
  /// (each the loss of its share of an equal split); collective, at Loop::end. One process,
  /// or a reducer that keeps each process's own figure: `loss`.
  virtual double global_loss(double loss) { return loss; }
};

/// Makes the reducer of each model a frugal::Loop prepares (LoopOptions::reducer);
/// distributed::Reducer is the one over a process group.
///
/// Example:
///   frugal::Loop loop(frugal::LoopOptions().reducer(
///       std::make_shared<frugal::distributed::Reducer>(group)));
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  /// The reducer of `module`'s gradients, the parameters of `optimizer` in its order (the
  /// same on every process); collective: every process copies rank 0's weights and buffers.
  virtual std::unique_ptr<ModelReducer> attach(torch::nn::Module& module,
                                               torch::optim::Optimizer& optimizer) = 0;
};

}  // namespace frugal
