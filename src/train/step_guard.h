// What an optimizer step changed, and undoing what it did not finish.
#pragma once

#include <c10/util/SmallVector.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace frugal::detail {

/// Taken just before an optimizer step, it tells afterwards which parameters the step
/// changed (the parameter's values or its optimizer-state tensors: their version counters
/// moved) and puts the optimizer state of every other parameter back as it was: state the
/// step created is removed, and state objects are restored from a shallow copy (counters
/// such as Adam's step; their tensors were not written, or the parameter counts as
/// changed). Costs one version read per tensor and one small copy per state object.
class OptimizerStepGuard {
 public:
  /// The versions of one parameter's state tensors (-1: undefined); most states hold few.
  using Versions = c10::SmallVector<std::int64_t, 4>;

  explicit OptimizerStepGuard(torch::optim::Optimizer& optimizer);

  /// The parameters whose values or state tensors the step wrote.
  std::vector<torch::Tensor> changed() const;
  /// Undoes the step's effect on the optimizer state of parameters it did not change.
  void restore_unchanged();

 private:
  struct Entry {
    torch::Tensor param;
    std::int64_t version = 0;
    std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: none before
    Versions state_versions;
  };
  bool changed(const Entry& entry) const;

  torch::optim::Optimizer& optimizer_;
  std::vector<Entry> entries_;
};

/// The names in `module` of `params` ("(a parameter outside the module)" for the others).
std::vector<std::string> parameter_names(const torch::nn::Module& module,
                                         const std::vector<torch::Tensor>& params);

}  // namespace frugal::detail
