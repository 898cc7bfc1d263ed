// The one error of a step that changed some parameters before it failed.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <exception>
#include <string>
#include <vector>

#include "frugal/error.h"

namespace frugal::detail {

/// The error of `failed` (e.g. "the optimizer step of 'model'"), which wrote the parameters
/// `changed` of `module` before it failed with `error`: it names them (PartialStepError::
/// updated carries the names) and says, after "Those hold new values;", what `after` holds
/// for the rest.
PartialStepError partial_step_error(const torch::nn::Module& module, const std::string& failed,
                                    const std::vector<torch::Tensor>& changed,
                                    const std::exception& error, const std::string& after);

}  // namespace frugal::detail
