#include "frugal/distributed/shard.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include "frugal/error.h"
#include "frugal/train/trainer.h"

namespace frugal::distributed {

Share share_of(std::int64_t n, int rank, int size) {
  FRUGAL_CHECK(size >= 1 && rank >= 0 && rank < size, "frugal: rank ", rank,
               " is not in a group of ", size);
  FRUGAL_CHECK(n >= 0, "frugal: cannot share ", n, " items");
  const std::int64_t base = n / size;
  const std::int64_t extra = n % size;
  return {rank * base + std::min<std::int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

Batch share_of(const Batch& batch, const Group& group) {
  const auto share = share_of(batch.size(), group.rank(), group.size());
  return batch.slice(share.start, share.length);
}

namespace {

// The ranks' reports combined: the loss over the global count, the accuracy over all
// samples, the samples summed.
void sum_over_ranks(EvalReport& report, Group& group) {
  const bool classes = report.accuracy >= 0;
  auto sums =
      torch::tensor(
          {report.loss * static_cast<double>(report.count), static_cast<double>(report.count),
           classes ? report.accuracy * static_cast<double>(report.scored) : 0.0,
           static_cast<double>(report.scored), static_cast<double>(report.samples)},
          torch::kDouble)
          .to(group.device());
  group.all_reduce(sums).wait();
  sums = sums.cpu();
  const auto* s = sums.data_ptr<double>();
  report.loss = s[1] > 0 ? s[0] / s[1] : 0.0;
  report.count = static_cast<std::int64_t>(s[1]);
  report.scored = static_cast<std::int64_t>(s[3]);
  report.samples = static_cast<std::int64_t>(s[4]);
  report.accuracy = classes && s[3] > 0 ? s[2] / s[3] : -1;
}

}  // namespace

EvalReport evaluate(Trainer& trainer, Group& group, const Batch& data) {
  const auto mine = share_of(data, group);
  FRUGAL_CHECK(mine.size() > 0, "frugal: rank ", group.rank(), " of ", group.size(),
               " gets no sample of an evaluation set of ", data.size());
  return trainer.evaluate(mine, EvaluateOptions().combine([&group](EvalReport& report) {
    sum_over_ranks(report, group);
  }));
}

}  // namespace frugal::distributed
