// What the 8-bit optimizer's tests share: parameters of several shapes, gradients that
// change size from step to step, the chunking and the state of one parameter.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#include <vector>

#include "compat.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/blockwise.h"
#include "helpers.h"

namespace frugal::testing::optim8bit {

namespace to = torch::optim;
namespace fo = frugal::optim;

// Parameters of several shapes: large ones of several chunks and blocks (one with a short
// last block), a small one (float32 states), one not contiguous (stepped whole).
inline std::vector<torch::Tensor> make_8bit_params() {
  torch::manual_seed(11);
  auto strided = torch::randn({100, 50}).t();
  return {torch::randn({64, 75}).requires_grad_(), torch::randn({9000}).requires_grad_(),
          torch::randn({75}).requires_grad_(), strided.detach().requires_grad_()};
}

// Gradients of a size that changes from step to step.
inline void set_growing_grads(std::vector<torch::Tensor>& params, int step) {
  frugal::testing::set_grads(params, step, 1 + step % 3);
}

inline double max_abs_diff(const std::vector<torch::Tensor>& a,
                           const std::vector<torch::Tensor>& b) {
  double most = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    most = std::max(most, (a[i] - b[i]).abs().max().item<double>());
  }
  return most;
}

// Chunks of three blocks: the 9000-element parameter takes four, the last one partial.
inline const fo::InPlaceOptions kChunks = fo::InPlaceOptions().chunk(768);

// A module holding `params`, for the ledger (p0, p1, ...).
struct ParamsModule : torch::nn::Module {
  explicit ParamsModule(const std::vector<torch::Tensor>& params) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::ostringstream name;
      name << "p" << i;
      register_parameter(name.str(), params[i]);
    }
  }
};

inline fo::Adam8bitParamState& state_of(to::Optimizer& o, const torch::Tensor& p) {
  return static_cast<fo::Adam8bitParamState&>(
      *o.state().at(frugal::compat::optimizer_state_key(p)));
}

}  // namespace frugal::testing::optim8bit
