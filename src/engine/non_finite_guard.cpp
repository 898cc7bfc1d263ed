#include "non_finite_guard.h"

#include <torch/torch.h>

namespace frugal::detail {

bool NonFiniteGuard::skips(bool loss_non_finite, const torch::optim::Optimizer& optimizer) const {
  return enabled_ && (loss_non_finite || (check_gradients_ && !gradients_finite(optimizer)));
}

bool gradients_finite(const torch::optim::Optimizer& optimizer) {
  // One flag on the device for all gradients, read once (one sync on CUDA, not one each).
  torch::NoGradGuard no_grad;
  torch::Tensor all_finite;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (p.grad().defined()) {
        const auto finite = torch::isfinite(p.grad()).all();
        all_finite = all_finite.defined() ? all_finite.logical_and(finite) : finite;
      }
    }
  }
  return !all_finite.defined() || all_finite.item<bool>();
}

}  // namespace frugal::detail
