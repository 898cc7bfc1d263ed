// The tensors of one parameter's optimizer state, visited without building a list.
#pragma once

#include <c10/util/FunctionRef.h>
#include <torch/optim/optimizer.h>

namespace frugal::detail {

/// Calls `fn` on each tensor of one parameter's optimizer state, in the order that
/// optimizer_state_tensors(state) lists them (it is built on this):
/// the step guard and the ledger read every parameter's state every step, where a list
/// (an allocation each) costs more than the reading.
void for_each_state_tensor(const torch::optim::OptimizerParamState& state,
                           c10::function_ref<void(const torch::Tensor&)> fn);

}  // namespace frugal::detail
