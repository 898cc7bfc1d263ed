// A batch of samples: inputs and (optionally) targets, split along the first dimension.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace frugal {

/// Inputs and targets whose first dimension is the sample dimension.
///
/// Example:
///   frugal::Batch batch{images, labels};
///   auto first_half = batch.slice(0, batch.size() / 2);
struct Batch {
  torch::Tensor inputs;
  torch::Tensor targets;  ///< may be undefined when the loss needs none

  /// Samples in the batch; throws when inputs are missing, scalar, or disagree with targets.
  std::int64_t size() const;
  /// Samples [start, start + length), as views.
  Batch slice(std::int64_t start, std::int64_t length) const;
  /// The batch on `device` (no copy when it is there already).
  Batch to(torch::Device device) const;
};

}  // namespace frugal
