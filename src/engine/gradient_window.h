// The accumulation window's gradients: the one place they are divided by the window's count.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "frugal/train/options.h"

namespace frugal::detail {

/// The gradients of an accumulation window of `accumulate` batches over an optimizer's
/// parameters: how many batches and how much count (samples or tokens) it holds, whether a
/// loss in it was not finite, and what is done to its gradients (taken aside and put back,
/// divided by the window's count, zeroed or released).
class GradientWindow {
 public:
  /// `reduction`: what the micro-batch losses are (LossReduction); a window of sums trains on
  /// their sum, never divided.
  GradientWindow(torch::optim::Optimizer& optimizer, std::int64_t accumulate, bool set_to_none,
                 LossReduction reduction = LossReduction::Mean);

  /// Between the first batch of a window and the step that ends it.
  bool open() const { return batches_ > 0; }
  std::int64_t batches() const { return batches_; }
  std::int64_t count() const { return count_; }
  /// Whether the next batch (of `count` more) completes the window.
  bool completes_with_next() const { return batches_ + 1 == accumulate_; }
  /// A batch of `count` that did not complete the window joins it.
  void add(std::int64_t count);
  /// Forgets the window (its gradients are the caller's to release).
  void drop();

  bool non_finite() const { return non_finite_; }
  void mark_non_finite() { non_finite_ = true; }

  /// The share of a micro-batch's loss of `count`: its count for a mean, 1 for a sum.
  double share(std::int64_t count) const;
  /// The weight of a micro-batch's loss whose share is `share` of a batch of `total`: over
  /// several batches the share alone, the division waiting for the window's end (scale); in
  /// a window of one batch, share / total; for a window of sums, the share alone.
  double weight(double share, std::int64_t total) const;
  /// What the window's summed gradients are multiplied by at its end, when it holds
  /// `count` in all: 1/count over several batches; 1 for a window of one batch, whose
  /// micro-batch losses carry their share already (weight), and for a window of sums.
  double scale(std::int64_t count) const;
  /// Multiplies every gradient by scale(count), except those `scaled` says are already.
  void divide(std::int64_t count, const std::function<bool(const torch::Tensor&)>& scaled);

  /// Takes every gradient off the parameters (in the optimizer's order; undefined where a
  /// parameter had none), leaving them without.
  std::vector<torch::Tensor> take();
  /// Puts taken gradients back: added to the gradients the parameters have now (`add`),
  /// or in their place.
  void put_back(std::vector<torch::Tensor> taken, bool add);
  /// Releases the gradients (set_to_none) or zeroes them in place.
  void zero();

 private:
  torch::optim::Optimizer& optimizer_;
  std::int64_t accumulate_;
  bool set_to_none_;
  LossReduction reduction_;
  std::int64_t batches_ = 0;
  std::int64_t count_ = 0;
  bool non_finite_ = false;  // a loss of the open window was NaN or infinite
};

}  // namespace frugal::detail
