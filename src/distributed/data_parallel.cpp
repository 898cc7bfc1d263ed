#include "frugal/distributed/data_parallel.h"

#include <torch/torch.h>

#include <utility>

#include "frugal/error.h"

namespace frugal::distributed {

DataParallel::DataParallel(std::shared_ptr<Group> group, DataParallelOptions options)
    : group_(std::move(group)), options_(options) {
  FRUGAL_CHECK(group_ != nullptr, "frugal: DataParallel needs a process group, got a null one");
  FRUGAL_CHECK(options_.bucket_bytes() > 0,
               "frugal: DataParallel's bucket_bytes must be positive, got ",
               options_.bucket_bytes());
}

void DataParallel::on_add(PolicyPort& port) {
  reducer_ = std::make_unique<BucketReducer>(group_,
                                             ReducerOptions()
                                                 .bucket_bytes(options_.bucket_bytes())
                                                 .broadcast_buffers(options_.broadcast_buffers()),
                                             port.module(), port.optimizer());
}

const std::vector<std::vector<std::size_t>>& DataParallel::buckets() const {
  FRUGAL_CHECK(reducer_ != nullptr, "frugal: DataParallel has no buckets before it is added");
  return reducer_->buckets();
}

std::int64_t DataParallel::last_global_count() const {
  return reducer_ != nullptr ? reducer_->last_global_count() : 0;
}

void DataParallel::on_step_begin(StepContext& ctx) {
  if (ctx.trial) {  // a measurement: nothing travels
    reducer_->gather_for_forward();
    return;
  }
  FRUGAL_CHECK(group_->size() == 1 || !in_step_, "frugal: rank ", group_->rank(),
               "'s last step failed, so the ranks are out of step; restart the run (from a "
               "saved training state)");
  in_step_ = group_->size() > 1;
  reducer_->begin();
}

void DataParallel::on_grad_ready(StepContext& ctx, const torch::Tensor& param) {
  if (!ctx.trial) {
    reducer_->add(param, {ctx.window_count, ctx.non_finite});
  }
}

void DataParallel::before_optimizer_step(StepContext& ctx) {
  if (!ctx.trial) {
    // Every rank skips the step when some rank's loss was not finite, as one process would.
    ctx.non_finite = reducer_->finalize({ctx.window_count, ctx.non_finite}).non_finite;
  }
}

void DataParallel::on_step_end(StepContext& ctx) {
  if (ctx.trial || group_->size() == 1) {
    return;
  }
  if (options_.global_loss()) {
    const double count = static_cast<double>(ctx.report.count);
    auto sums =
        torch::tensor({ctx.report.loss * count, count}, torch::kDouble).to(group_->device());
    group_->all_reduce(sums).wait();
    sums = sums.cpu();
    ctx.report.loss = sums[0].item<double>() / sums[1].item<double>();
  }
  in_step_ = false;
}

}  // namespace frugal::distributed
