#include "frugal/optim/adam.h"

#include <torch/torch.h>

#include <cmath>

namespace frugal::optim {
namespace {

// Adam's state for `param`, of either kind (AdamParamState or AdamWParamState).
template <typename State>
std::unique_ptr<torch::optim::OptimizerParamState> adam_state(const torch::Tensor& param,
                                                              bool amsgrad) {
  auto state = std::make_unique<State>();
  state->step(0);
  state->exp_avg(torch::empty_like(param, torch::MemoryFormat::Preserve));
  state->exp_avg_sq(torch::empty_like(param, torch::MemoryFormat::Preserve));
  if (amsgrad) {
    state->max_exp_avg_sq(torch::empty_like(param, torch::MemoryFormat::Preserve));
  }
  return state;
}

// One step of Adam (coupled: L2 weight decay added to the gradient) or AdamW (decoupled:
// the parameter shrunk first), in LibTorch's order of operations, chunk by chunk.
template <typename Options, typename State>
void adam_update(ParamUpdate& u, bool decoupled) {
  const auto& o = static_cast<const Options&>(u.options);
  auto& state = static_cast<State&>(*u.state);
  state.step(state.step() + 1);
  const auto [beta1, beta2] = o.betas();
  const double bias_correction1 = 1 - std::pow(beta1, state.step());
  const double bias_correction2 = 1 - std::pow(beta2, state.step());
  const double step_size = o.lr() / bias_correction1;
  for_each_chunk(u, [&](std::int64_t offset, std::int64_t n) {
    auto p = u.part(u.param, offset, n);
    auto grad = u.part(u.grad, offset, n);
    if (o.weight_decay() != 0) {
      if (decoupled) {
        p.mul_(1 - o.lr() * o.weight_decay());
      } else {
        auto decayed = u.scratch_part(1, n);
        at::add_out(decayed, grad, p, o.weight_decay());
        grad = decayed;
      }
    }
    auto exp_avg = u.part(state.exp_avg(), offset, n);
    auto exp_avg_sq = u.part(state.exp_avg_sq(), offset, n);
    if (u.fresh) {  // torch starts the moments from zeros
      exp_avg.zero_();
      exp_avg_sq.zero_();
    }
    exp_avg.mul_(beta1).add_(grad, 1 - beta1);
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
    auto denom = u.scratch_part(0, n);
    if (o.amsgrad()) {
      auto max_exp_avg_sq = u.part(state.max_exp_avg_sq(), offset, n);
      if (u.fresh) {
        max_exp_avg_sq.zero_();
      }
      at::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
      at::sqrt_out(denom, max_exp_avg_sq);
    } else {
      at::sqrt_out(denom, exp_avg_sq);
    }
    denom.div_(std::sqrt(bias_correction2)).add_(o.eps());
    p.addcdiv_(exp_avg, denom, -step_size);
  });
}

}  // namespace

using torch::optim::AdamOptions;
using torch::optim::AdamParamState;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

std::unique_ptr<torch::optim::OptimizerParamState> Adam::make_state(
    const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const {
  return adam_state<AdamParamState>(param, static_cast<const AdamOptions&>(options).amsgrad());
}

int Adam::scratch_buffers(const torch::optim::OptimizerOptions& options) const {
  return static_cast<const AdamOptions&>(options).weight_decay() != 0 ? 2 : 1;
}

void Adam::update(ParamUpdate& u) const { adam_update<AdamOptions, AdamParamState>(u, false); }

std::unique_ptr<torch::optim::OptimizerParamState> AdamW::make_state(
    const torch::Tensor& param, const torch::optim::OptimizerOptions& options) const {
  return adam_state<AdamWParamState>(param, static_cast<const AdamWOptions&>(options).amsgrad());
}

int AdamW::scratch_buffers(const torch::optim::OptimizerOptions&) const { return 1; }

void AdamW::update(ParamUpdate& u) const { adam_update<AdamWOptions, AdamWParamState>(u, true); }

}  // namespace frugal::optim
