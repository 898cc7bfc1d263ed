// How the trainer cuts a batch into micro-batches, and counts each one's share.
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>

#include "frugal/train/trainer.h"
#include "frugal/error.h"

namespace frugal {

std::int64_t Trainer::count_of(const Batch& micro) const {
  if (!options_.count()) {
    return micro.inputs.size(0);
  }
  const std::int64_t n = options_.count()(micro);
  FRUGAL_CHECK(n >= 0, "frugal: the count function returned ", n, " for a micro-batch");
  return n;
}

std::vector<std::int64_t> Trainer::plan(std::int64_t samples) const {
  std::vector<std::int64_t> sizes;
  if (options_.micro_batches() && micro_batch_ == 0) {  // unless a policy set a size
    // K near-equal parts, the first ones one larger (torch::tensor_split's rule).
    const std::int64_t parts = std::min(*options_.micro_batches(), samples);
    for (std::int64_t i = 0; i < parts; ++i) {
      sizes.push_back(samples / parts + (i < samples % parts ? 1 : 0));
    }
    return sizes;
  }
  const std::int64_t m = micro_batch_ > 0 ? std::min(micro_batch_, samples) : samples;
  for (std::int64_t start = 0; start < samples; start += m) {
    sizes.push_back(std::min(m, samples - start));
  }
  return sizes;
}

Trainer::Split Trainer::split(const Batch& batch) const {
  Split out;
  std::int64_t offset = 0;
  const std::int64_t samples = batch.inputs.size(0);
  for (const auto size : plan(samples)) {
    // The whole batch in one part is the batch itself: no view of each tensor to make.
    out.micros.push_back(size == samples ? batch : batch.slice(offset, size));
    out.counts.push_back(count_of(out.micros.back()));
    out.total += out.counts.back();
    offset += size;
  }
  FRUGAL_CHECK(out.total > 0, "frugal: the batch's global count is ", out.total,
               "; it must be positive to normalise the loss");
  return out;
}

}  // namespace frugal
