#include "gradient_window.h"

#include "frugal/memory/memory_context.h"
#include <torch/torch.h>

namespace frugal::detail {

GradientWindow::GradientWindow(torch::optim::Optimizer& optimizer, std::int64_t accumulate,
                               bool set_to_none, LossReduction reduction)
    : optimizer_(optimizer),
      accumulate_(accumulate),
      set_to_none_(set_to_none),
      reduction_(reduction) {}

void GradientWindow::add(std::int64_t count) {
  count_ += count;
  ++batches_;
}

void GradientWindow::drop() {
  batches_ = 0;
  count_ = 0;
  non_finite_ = false;
}

double GradientWindow::share(std::int64_t count) const {
  return reduction_ == LossReduction::Mean ? static_cast<double>(count) : 1.0;
}

double GradientWindow::weight(double share, std::int64_t total) const {
  return reduction_ == LossReduction::Sum || accumulate_ > 1 ? share
                                                             : share / static_cast<double>(total);
}

double GradientWindow::scale(std::int64_t count) const {
  return reduction_ != LossReduction::Sum && accumulate_ > 1 ? 1.0 / static_cast<double>(count)
                                                             : 1.0;
}

void GradientWindow::divide(std::int64_t count,
                            const std::function<bool(const torch::Tensor&)>& scaled) {
  const double factor = scale(count);
  if (factor == 1.0) {
    return;
  }
  torch::NoGradGuard no_grad;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined() && !(scaled && scaled(p))) {
        p.mutable_grad().mul_(factor);
      }
    }
  }
}

std::vector<torch::Tensor> GradientWindow::take() {
  std::vector<torch::Tensor> taken;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      taken.push_back(p.grad());
      p.mutable_grad().reset();
    }
  }
  return taken;
}

void GradientWindow::put_back(std::vector<torch::Tensor> taken, bool add) {
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      auto& old = taken.at(i++);
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

void GradientWindow::zero() {
  torch::NoGradGuard no_grad;
  const PhaseScope phase(MemoryPhase::Zeroing);
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      auto& grad = p.mutable_grad();
      if (!grad.defined()) {
        continue;
      }
      if (set_to_none_) {
        grad.reset();
      } else {
        grad = grad.detach();
        grad.zero_();
      }
    }
  }
}

}  // namespace frugal::detail
