// Adam and AdamW (AMSGrad, weight decay) updating each parameter in place.
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include "frugal/optim/in_place.h"

namespace frugal::optim {

namespace detail {
// The updates, in adam.cpp; so are InPlace's functions for them (explicit instantiations).
struct AdamRule;
struct AdamWRule;
}  // namespace detail

extern template class InPlace<torch::optim::Adam, torch::optim::AdamOptions, detail::AdamRule>;
extern template class InPlace<torch::optim::AdamW, torch::optim::AdamWOptions, detail::AdamWRule>;

/// LibTorch's Adam with frugal's step: in place, chunk by chunk, all or nothing (see
/// InPlaceOptimizer). LibTorch's step allocates two temporaries the size of each parameter
/// for the denominator (three with weight decay); this one a chunk's worth. Options, state
/// (exp_avg, exp_avg_sq, max_exp_avg_sq, step) and serialization are torch's, and the
/// arithmetic is the same, element by element.
///
/// Example:
///   frugal::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
class Adam : public InPlace<torch::optim::Adam, torch::optim::AdamOptions, detail::AdamRule> {
 public:
  using InPlace::InPlace;  // (params or groups, AdamOptions = {}, InPlaceOptions = {})
};

/// LibTorch's AdamW (decoupled weight decay) with frugal's step; see Adam.
///
/// Example:
///   frugal::optim::AdamW adamw(model->parameters(),
///                              torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
class AdamW : public InPlace<torch::optim::AdamW, torch::optim::AdamWOptions, detail::AdamWRule> {
 public:
  using InPlace::InPlace;  // (params or groups, AdamWOptions = {}, InPlaceOptions = {})
};

}  // namespace frugal::optim
