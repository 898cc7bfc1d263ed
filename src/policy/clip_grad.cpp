#include "frugal/policy/clip_grad.h"

#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

#include "frugal/error.h"

namespace frugal {

ClipGrad::ClipGrad(ClipGradOptions options) : options_(options) {
  detail::check_at_least(options_.max_norm(), 0, "max_norm");
  detail::check_at_least(options_.max_value(), 0, "max_value");
  FRUGAL_CHECK(options_.max_norm() > 0 || options_.max_value() > 0,
               "frugal: ClipGrad needs max_norm or max_value > 0");
}

void ClipGrad::before_optimizer_step(StepContext& ctx) {
  ctx.port.unscale_gradients();
  std::vector<torch::Tensor> params;
  for (auto& group : ctx.optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) {
        params.push_back(p);
      }
    }
  }
  if (options_.max_value() > 0) {
    torch::nn::utils::clip_grad_value_(params, options_.max_value());
  }
  if (options_.max_norm() > 0) {
    last_norm_ =
        torch::nn::utils::clip_grad_norm_(params, options_.max_norm(), options_.norm_type());
  }
}

}  // namespace frugal
