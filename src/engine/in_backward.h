// What kind of optimizer the engine was given, asked once; and the optimizer step inside
// backward: each parameter updated as soon as its gradient is ready, the gradient released.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "frugal/optim/in_place.h"
#include "frugal/optim/sharded.h"

namespace frugal::detail {

/// `optimizer` as one that updates a parameter at a time (frugal's SGD, Adam, AdamW and the
/// low-bit ones), or an error naming `who` asked ("StepInBackward", "Loop::backward_step of
/// 'model'") and the optimizer's type.
optim::InPlaceOptimizer& in_place_optimizer(torch::optim::Optimizer& optimizer,
                                            const std::string& who);

/// `optimizer` as one that shards parameters or gradients over the processes (ZeRO), or null.
optim::ShardedOptimizer* sharded_optimizer(torch::optim::Optimizer& optimizer);

/// Updates `param` from its gradient, records it in `updated` (what a failure must name)
/// and releases the gradient.
inline void step_in_backward(optim::InPlaceOptimizer& optimizer, const torch::Tensor& param,
                             std::vector<torch::Tensor>& updated) {
  optimizer.step_parameter(param);
  updated.push_back(param);
  param.mutable_grad().reset();
}

}  // namespace frugal::detail
