// The engine's one "this parameter's gradient is ready" mechanism.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "compat.h"

namespace frugal::detail {

/// Hooks every parameter of an optimizer (that requires grad) once, and while armed,
/// delivers each parameter whose gradient autograd has just accumulated: first adding the
/// window's gradient held aside (if any), then scaling it by the window's 1/count, then
/// calling `deliver`. Disarmed, the hooks do nothing.
class GradReady {
 public:
  using Deliver = std::function<void(const torch::Tensor& param)>;
  GradReady(torch::optim::Optimizer& optimizer, Deliver deliver);

  /// Arms the hooks for one backward. `aside`: gradients of the window's earlier batches,
  /// in the optimizer's parameter order (empty if none); `scale`: the window's 1/count.
  void arm(std::vector<torch::Tensor>* aside, double scale);
  void disarm();
  /// Whether `param` was delivered since the last clear(): its gradient is scaled already.
  bool delivered(const torch::Tensor& param) const;
  std::size_t delivered_count() const { return delivered_count_; }
  void clear();

 private:
  void on_accumulated(const torch::Tensor& param);

  Deliver deliver_;
  std::unordered_map<const void*, std::size_t> index_;  // TensorImpl -> position
  std::vector<char> delivered_;
  std::size_t delivered_count_ = 0;
  std::vector<std::unique_ptr<compat::GradAccumulatedHook>> hooks_;
  bool armed_ = false;
  std::vector<torch::Tensor>* aside_ = nullptr;
  double scale_ = 1;
};

/// Arms a GradReady for one scope (one backward), disarming it however the scope ends.
class ArmedScope {
 public:
  ArmedScope(GradReady* ready, std::vector<torch::Tensor>* aside, double scale) : ready_(ready) {
    if (ready_ != nullptr) {
      ready_->arm(aside, scale);
    }
  }
  ~ArmedScope() {
    if (ready_ != nullptr) {
      ready_->disarm();
    }
  }
  ArmedScope(const ArmedScope&) = delete;
  ArmedScope& operator=(const ArmedScope&) = delete;

 private:
  GradReady* ready_;
};

}  // namespace frugal::detail
