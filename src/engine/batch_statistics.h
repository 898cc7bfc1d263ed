// Layers whose output depends on the whole batch, which micro-batches would change.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "frugal/train/options.h"

namespace frugal::detail {

/// The names (in `module`'s tree) of its layers in training mode that normalize by batch
/// statistics: LibTorch's BatchNorm1d, 2d and 3d.
std::vector<std::string> batch_statistics_layers(const torch::nn::Module& module);

/// Whether `choice` runs `module`'s batches whole (WholeBatch, and it has such layers).
bool keeps_whole_batch(BatchStatistics choice, const torch::nn::Module& module);

/// Applies the BatchStatistics choice the first time a batch runs as `micro_batches` > 1
/// micro-batches: warns once, refuses (throws, naming the layers), or accepts. Under Warn
/// (and WholeBatch, whose batches are cut only by a later choice of size) the model is looked
/// at once, at the first batch split into micro-batches.
class BatchStatisticsCheck {
 public:
  explicit BatchStatisticsCheck(BatchStatistics choice) : choice_(choice) {}
  void check(const torch::nn::Module& module, std::int64_t micro_batches, std::int64_t size);

 private:
  BatchStatistics choice_;
  bool warned_ = false;  // under Warn: looked at (and warned, if there was reason)
};

}  // namespace frugal::detail
