// SGD (momentum, dampening, Nesterov, weight decay) updating each parameter in place.
#pragma once

#include <torch/optim/sgd.h>

#include "frugal/optim/in_place.h"

namespace frugal::optim {

namespace detail {
struct SGDRule;  // the update, in sgd.cpp, with InPlace's functions for it
}  // namespace detail

extern template class InPlace<torch::optim::SGD, torch::optim::SGDOptions, detail::SGDRule>;

/// LibTorch's SGD with frugal's step: in place, chunk by chunk, all or nothing (see
/// InPlaceOptimizer). Options, state (momentum buffers) and serialization are torch's.
/// Same arithmetic as torch::optim::SGD, element by element.
///
/// Example:
///   frugal::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
class SGD : public InPlace<torch::optim::SGD, torch::optim::SGDOptions, detail::SGDRule> {
 public:
  using InPlace::InPlace;  // (params or groups, SGDOptions, InPlaceOptions = {})
};

}  // namespace frugal::optim
