#include "grad_ready.h"

#include <torch/torch.h>

namespace frugal::detail {

GradReady::GradReady(torch::optim::Optimizer& optimizer, Deliver deliver)
    : deliver_(std::move(deliver)) {
  std::size_t position = 0;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      index_[p.unsafeGetTensorImpl()] = position++;
      if (p.requires_grad()) {
        hooks_.push_back(compat::on_grad_accumulated(
            p, [this](const torch::Tensor& param) { on_accumulated(param); }));
      }
    }
  }
  delivered_.assign(position, 0);
}

void GradReady::arm(std::vector<torch::Tensor>* aside, double scale) {
  armed_ = true;
  aside_ = aside != nullptr && !aside->empty() ? aside : nullptr;
  scale_ = scale;
}

void GradReady::disarm() {
  armed_ = false;
  aside_ = nullptr;
}

bool GradReady::delivered(const torch::Tensor& param) const {
  const auto it = index_.find(param.unsafeGetTensorImpl());
  return it != index_.end() && delivered_[it->second] != 0;
}

void GradReady::clear() {
  std::fill(delivered_.begin(), delivered_.end(), 0);
  delivered_count_ = 0;
}

void GradReady::on_accumulated(const torch::Tensor& param) {
  if (!armed_) {
    return;
  }
  const auto it = index_.find(param.unsafeGetTensorImpl());
  if (it == index_.end() || delivered_[it->second] != 0) {
    return;  // delivered once per step, even if autograd accumulates into it again
  }
  {
    torch::NoGradGuard no_grad;
    auto& grad = param.mutable_grad();
    if (aside_ != nullptr) {
      auto& earlier = aside_->at(it->second);
      if (earlier.defined()) {
        grad.add_(earlier);
        earlier = torch::Tensor();
      }
    }
    if (scale_ != 1.0) {
      grad.mul_(scale_);
    }
  }
  delivered_[it->second] = 1;
  ++delivered_count_;
  deliver_(param);
}

}  // namespace frugal::detail
