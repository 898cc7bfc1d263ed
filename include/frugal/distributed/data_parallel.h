// Data-parallel training: every rank holds the model; gradients are averaged over ranks.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/distributed/reducer.h"
#include "frugal/train/policy.h"

namespace frugal::distributed {

struct DataParallelOptions {
  /// As ReducerOptions::bucket_bytes (DDP's bucket_cap_mb, 25 MiB).
  TORCH_ARG(std::int64_t, bucket_bytes) = std::int64_t{25} << 20;
  /// As ReducerOptions::broadcast_buffers (DDP's broadcast_buffers).
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Report the loss of the global batch (every rank's samples), one small all-reduce a
  /// batch; off, each rank reports its own.
  TORCH_ARG(bool, global_loss) = true;
};

/// The Trainer's data parallelism, a policy over the one BucketReducer (which frugal::Loop
/// uses through distributed::Reducer): averages gradients over the ranks of `group` so
/// that every rank takes the step one process would take on the union of the ranks' batches.
/// Parameters and buffers are copied from rank 0 when the policy is added; from then on the ranks
/// stay identical.
///
/// The average is exact by the global count: each rank's gradient (its own window's mean)
/// is weighted by its count (samples, or the TrainerOptions::count, e.g. tokens) over the
/// sum of all ranks' counts, so ranks may hold different numbers of tokens. Gradients go out
/// in buckets from the engine's gradient-ready calls during the backward that completes the
/// optimizer step, in the same order on every rank; earlier micro-batches and accumulation
/// batches communicate nothing. Every rank then holds the same gradients, so a GradScaler's
/// inf/NaN decision and a clipping norm agree without more communication.
///
/// With a ZeroOptimizer of stage 2 as the trainer's optimizer, each averaged bucket leaves
/// only the part this rank owns (in the optimizer's range) and is freed; the parameters get
/// no gradient, so policies that read every gradient are refused beside it.
/// With one of stage 3, the parameters are gathered whole when a step begins (with units:
/// the root unit; each unit gathers itself around its calls) and released once the backward
/// that completes the step has delivered its buckets.
///
/// Add it before policies that read every gradient (GradScalerPolicy, ClipGrad) and
/// before OomRecovery; refused after them. Retries of a failed forward or backward (OomRecovery)
/// stay on their rank, as nothing travels before the backward that completes the step; a
/// failure after its gradients began to travel is raised, not retried. A step that failed on
/// one rank leaves the ranks out of step: that rank's next step is refused, and the other
/// ranks fail at their next collective (when the failing process exits, or at the group's
/// timeout) rather than hang.
///
/// Example:
///   auto group =
///   frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment());
///   frugal::Trainer trainer(model, adam, loss_fn);
///   trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(group));
///   trainer.step(my_share_of_the_batch);
class DataParallel : public Policy {
 public:
  explicit DataParallel(std::shared_ptr<Group> group, DataParallelOptions options = {});
  std::string name() const override { return "data-parallel"; }
  /// Gradient-ready calls; it shares gradients among the processes during backward.
  Traits traits() const override { return Trait::GradReady | Trait::SharesGradients; }
  void on_add(PolicyPort& port) override;
  void on_step_begin(StepContext& ctx) override;
  void on_grad_ready(StepContext& ctx, const torch::Tensor& param) override;
  void before_optimizer_step(StepContext& ctx) override;
  void on_step_end(StepContext& ctx) override;

  const Group& group() const { return *group_; }
  /// Parameter indices (in the optimizer's order) of each bucket, in sending order.
  const std::vector<std::vector<std::size_t>>& buckets() const;
  /// The global count of the last optimizer step (all ranks' window counts summed).
  std::int64_t last_global_count() const;

 private:
  std::shared_ptr<Group> group_;
  DataParallelOptions options_;
  std::unique_ptr<BucketReducer> reducer_;  // the model's, made when added
  bool in_step_ = false;  // between a step's begin and its end: set when a step failed
};

}  // namespace frugal::distributed
