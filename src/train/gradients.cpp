// The trainer's handling of gradients: zeroing, and holding a window's gradients aside.
#include <torch/torch.h>

#include "frugal/train/trainer.h"

namespace frugal {

void Trainer::zero_grads() {
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      auto& grad = p.mutable_grad();
      if (!grad.defined()) {
        continue;
      }
      if (options_.set_to_none()) {
        grad.reset();
      } else {
        grad = grad.detach();
        grad.zero_();
      }
    }
  }
}

std::vector<torch::Tensor> Trainer::take_grads() {
  std::vector<torch::Tensor> taken;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      taken.push_back(p.grad());
      p.mutable_grad().reset();
    }
  }
  return taken;
}

void Trainer::put_back_grads(std::vector<torch::Tensor> aside, bool add) {
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      auto& old = aside.at(i++);
      auto& grad = p.mutable_grad();
      if (add && grad.defined() && old.defined()) {
        grad.add_(old);
      } else if (!grad.defined() || !add) {
        grad = old;
      }
      old = torch::Tensor();
    }
  }
}

}  // namespace frugal
