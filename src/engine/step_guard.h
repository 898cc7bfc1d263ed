// What an optimizer step changed, and undoing what it did not finish.
#pragma once

#include <c10/util/SmallVector.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

namespace frugal::detail {

/// Taken just before an optimizer step, it tells afterwards which parameters the step
/// changed (the parameter's values or its optimizer-state tensors: their version counters
/// moved, or the state holds other tensors) and puts the optimizer state of every other
/// parameter back as it was: state the step created is removed, and the counters of the
/// state objects (such as Adam's step) are restored. LibTorch's Adam, AdamW and SGD states
/// are recorded by their counter, with no allocation; other states by a shallow copy.
/// Costs one version read per tensor, taken every step.
class OptimizerStepGuard {
 public:
  explicit OptimizerStepGuard(torch::optim::Optimizer& optimizer);

  /// The parameters whose values or state tensors the step wrote.
  std::vector<torch::Tensor> changed() const;
  /// Undoes the step's effect on the optimizer state of parameters it did not change.
  void restore_unchanged();

 private:
  // One state tensor as it was: held, so that its address names it alone during the step.
  struct Held {
    torch::Tensor tensor;
    std::int64_t version;
  };
  struct Entry {
    torch::Tensor param;
    std::int64_t version = 0;
    const std::type_info* type = nullptr;  // the state's type; null: no state before
    std::int64_t step = 0;                 // Adam's and AdamW's counter
    std::unique_ptr<torch::optim::OptimizerParamState> copy;  // states of other types
    c10::SmallVector<Held, 4> tensors;
  };
  bool changed(const Entry& entry) const;

  torch::optim::Optimizer& optimizer_;
  std::vector<Entry> entries_;
};

/// The names in `module` of `params` ("(a parameter outside the module)" for the others).
std::vector<std::string> parameter_names(const torch::nn::Module& module,
                                         const std::vector<torch::Tensor>& params);

}  // namespace frugal::detail
