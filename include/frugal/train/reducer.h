// What data parallelism does to a model's gradients before its step, as the engine asks it.
#pragma once

#include <torch/types.h>

#include <vector>

namespace frugal {

/// Makes a model's gradients the same on every process before its optimizer steps (the
/// mean over the processes, each having backpropagated its share of the batch), and makes
/// the processes agree on a decision. frugal::Loop calls it at each step
/// (LoopOptions::reducer); distributed::GradientAverage is the one over a process group.
///
/// Example:
///   frugal::Loop loop(frugal::LoopOptions().reducer(
///       std::make_shared<frugal::distributed::GradientAverage>(group)));
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  /// Replaces each gradient (the defined ones of one model, in its optimizer's order, the
  /// same on every process) by its mean over the processes.
  virtual void reduce(const std::vector<torch::Tensor>& gradients) = 0;
  /// Whether `value` is true on any process.
  virtual bool any(bool value) = 0;
};

}  // namespace frugal
