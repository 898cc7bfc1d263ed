// What each rank takes of the data: its share of a batch, and evaluation over all shares.
#pragma once

#include <cstdint>

#include "frugal/distributed/group.h"
#include "frugal/train/batch.h"
#include "frugal/train/step_report.h"

namespace frugal {
class Trainer;
}

namespace frugal::distributed {

/// Items [start, start + length) of a batch of `n`: rank `rank` of `size` ranks takes its
/// share in rank order, the first n % size ranks one more (torch::tensor_split's rule).
struct Share {
  std::int64_t start = 0;
  std::int64_t length = 0;
};
Share share_of(std::int64_t n, int rank, int size);

/// This rank's share of `batch` (views).
Batch share_of(const Batch& batch, const Group& group);

/// Evaluates this rank's share of `data` and combines the ranks' reports: the loss over the
/// global count, the accuracy over all samples, the samples summed (what the trainer's
/// sinks receive). Memory figures stay this rank's. Every rank must call it.
EvalReport evaluate(Trainer& trainer, Group& group, const Batch& data);

}  // namespace frugal::distributed
