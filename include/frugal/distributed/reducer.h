// The mean of a model's gradients over a process group, for frugal::Loop.
#pragma once

#include <memory>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/train/reducer.h"

namespace frugal::distributed {

/// Averages gradients over `group` in one all-reduce per dtype and device (the gradients
/// flattened into one buffer, as a DDP bucket): after it every process holds the mean of
/// the processes' gradients, the gradient of the whole batch when each process
/// backpropagated the mean loss of an equal share of it.
///
/// Example:
///   auto group =
///   frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment());
///   frugal::Loop loop(frugal::LoopOptions().reducer(
///       std::make_shared<frugal::distributed::GradientAverage>(group)));
class GradientAverage : public GradientReducer {
 public:
  explicit GradientAverage(std::shared_ptr<Group> group);
  void reduce(const std::vector<torch::Tensor>& gradients) override;
  bool any(bool value) override;
  const Group& group() const { return *group_; }

 private:
  std::shared_ptr<Group> group_;
};

}  // namespace frugal::distributed
