// Which modules of a model a CheckpointSelect picks: the checkpoint policy's blocks, and the
// units whose weights the planner may store in 8 bits.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

#include "frugal/policy/checkpoint_policy.h"

namespace frugal::detail {

struct SelectedModule {
  std::string name;  ///< qualified, as in named_modules()
  std::shared_ptr<torch::nn::Module> module;
  torch::nn::Module* parent;
  std::size_t index;  ///< among the parent's children
};

/// The modules of `root` that `select` picks, in named_modules() order; a module inside a
/// picked one is not picked again, nor a checkpoint wrapper. An error, naming `who`, for a
/// name, a type or an `every` rule that matches nothing.
std::vector<SelectedModule> select_modules(torch::nn::Module& root, const CheckpointSelect& select,
                                           const std::string& who);

}  // namespace frugal::detail
