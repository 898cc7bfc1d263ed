// The sum of a step's losses, kept without a host read where one would stall a device.
#pragma once

#include <ATen/ATen.h>

namespace frugal::detail {

/// Adds scalar losses, each times a factor. A loss on the CPU is read at once (a read costs
/// nothing there); a loss on a device joins a sum on that device, read when `value()` is
/// asked: the host then waits once for the work that made them, not once per loss before
/// its backward is launched. The sum is NaN or infinite exactly when an added loss times
/// its factor was. Copies are snapshots (adding never writes into a tensor a copy shares).
class LossTally {
 public:
  /// `defer_cpu`: CPU losses are summed as tensors too (the device's way, for its tests).
  explicit LossTally(bool defer_cpu = false) : defer_cpu_(defer_cpu) {}
  /// One loss times its factor, made once where it goes into several tallies.
  struct Term {
    double host = 0;
    at::Tensor device;  ///< defined: the term is on the device, unread
  };
  Term term(const at::Tensor& loss, double factor) const {
    if (loss.device().is_cpu() && !defer_cpu_) {
      return {loss.detach().item<double>() * factor, at::Tensor()};
    }
    return {0, loss.detach().reshape({}).to(at::kDouble) * factor};
  }
  void add(const Term& t) {
    if (!t.device.defined()) {
      host_ += t.host;
      return;
    }
    device_ = device_.defined() ? device_ + t.device : t.device;
  }
  void add(const at::Tensor& loss, double factor) { add(term(loss, factor)); }
  /// The sum, read from the device if a device loss was added since the last read.
  double value() {
    if (device_.defined()) {
      host_ += device_.item<double>();
      device_ = at::Tensor();
    }
    return host_;
  }
  /// Whether losses wait on their device to be read.
  bool pending() const { return device_.defined(); }
  void clear() { *this = LossTally(defer_cpu_); }

 private:
  bool defer_cpu_;
  double host_ = 0;
  at::Tensor device_;
};

}  // namespace frugal::detail
