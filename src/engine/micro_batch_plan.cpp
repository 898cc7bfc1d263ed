#include "micro_batch_plan.h"

#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>
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

template <typename Part>
void MicroBatchPlan::for_each_size(std::int64_t samples, std::int64_t size, Part part) const {
  if (parts_ && size == 0) {  // unless a policy set a size
    // K near-equal parts, the first ones one larger (torch::tensor_split's rule).
    const std::int64_t parts = std::min(*parts_, samples);
    for (std::int64_t i = 0; i < parts; ++i) {
      part(samples / parts + (i < samples % parts ? 1 : 0));
    }
    return;
  }
  const std::int64_t m = size > 0 ? std::min(size, samples) : samples;
  for (std::int64_t start = 0; start < samples; start += m) {
    part(std::min(m, samples - start));
  }
}

std::vector<std::int64_t> MicroBatchPlan::sizes(std::int64_t samples, std::int64_t size) const {
  std::vector<std::int64_t> out;
  for_each_size(samples, size, [&](std::int64_t n) { out.push_back(n); });
  return out;
}

MicroBatchPlan::Split MicroBatchPlan::split(const Batch& batch, std::int64_t size) const {
  Split out;
  split_into(batch, size, out);
  return out;
}

void MicroBatchPlan::split_into(const Batch& batch, std::int64_t size, Split& out) const {
  out.clear();
  auto failed = c10::make_scope_exit([&] { out.clear(); });
  std::int64_t offset = 0;
  const std::int64_t samples = batch.inputs.size(0);
  for_each_size(samples, size, [&](std::int64_t part) {
    // The whole batch in one part is the batch itself: no view of each tensor to make.
    out.micros.push_back(part == samples ? batch : batch.slice(offset, part));
    out.counts.push_back(count(out.micros.back()));
    out.total += out.counts.back();
    offset += part;
  });
  FRUGAL_CHECK(out.total > 0, "frugal: the batch's global count is ", out.total,
               "; it must be positive to normalise the loss");
  failed.release();
}

}  // namespace frugal::detail
