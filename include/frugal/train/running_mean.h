// A running mean of logged numbers: holds doubles, never a tensor or its graph.
#pragma once

#include <cstdint>

namespace frugal {

/// Example:
///   frugal::RunningMean loss;
///   loss.add(report.loss, report.samples);
///   fmt::print("epoch loss {:.4f}\n", loss.mean());
class RunningMean {
 public:
  void add(double value, double weight = 1.0) {
    sum_ += value * weight;
    weight_ += weight;
    ++count_;
  }
  double mean() const { return weight_ > 0 ? sum_ / weight_ : 0.0; }
  std::int64_t count() const { return count_; }
  /// The weighted sum and the weight: with count(), all a saved run needs (restore()).
  double sum() const { return sum_; }
  double weight() const { return weight_; }
  void restore(double sum, double weight, std::int64_t count) {
    sum_ = sum;
    weight_ = weight;
    count_ = count;
  }
  void reset() { *this = RunningMean(); }

 private:
  double sum_ = 0;
  double weight_ = 0;
  std::int64_t count_ = 0;
};

}  // namespace frugal
