#include "micro_batch_plan.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>

#include "frugal/error.h"

namespace frugal::detail {

MicroBatchPlan::MicroBatchPlan(c10::optional<std::int64_t> parts, CountFn count)
    : parts_(parts), count_(std::move(count)) {}

std::int64_t MicroBatchPlan::count(const Batch& micro) const {
  if (!count_) {
    return micro.inputs.size(0);
  }
  const std::int64_t n = count_(micro);
  FRUGAL_CHECK(n >= 0, "frugal: the count function returned ", n, " for a micro-batch");
  return n;
}

std::vector<std::int64_t> MicroBatchPlan::sizes(std::int64_t samples, std::int64_t size) const {
  std::vector<std::int64_t> out;
  if (parts_ && size == 0) {  // unless a policy set a size
    // K near-equal parts, the first ones one larger (torch::tensor_split's rule).
    const std::int64_t parts = std::min(*parts_, samples);
    for (std::int64_t i = 0; i < parts; ++i) {
      out.push_back(samples / parts + (i < samples % parts ? 1 : 0));
    }
    return out;
  }
  const std::int64_t m = size > 0 ? std::min(size, samples) : samples;
  for (std::int64_t start = 0; start < samples; start += m) {
    out.push_back(std::min(m, samples - start));
  }
  return out;
}

MicroBatchPlan::Split MicroBatchPlan::split(const Batch& batch, std::int64_t size) const {
  Split out;
  std::int64_t offset = 0;
  const std::int64_t samples = batch.inputs.size(0);
  for (const auto part : sizes(samples, size)) {
    // The whole batch in one part is the batch itself: no view of each tensor to make.
    out.micros.push_back(part == samples ? batch : batch.slice(offset, part));
    out.counts.push_back(count(out.micros.back()));
    out.total += out.counts.back();
    offset += part;
  }
  FRUGAL_CHECK(out.total > 0, "frugal: the batch's global count is ", out.total,
               "; it must be positive to normalise the loss");
  return out;
}

}  // namespace frugal::detail
