// Data-parallel training: every rank holds the model; gradients are averaged over ranks.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/optim/sharded.h"
#include "frugal/train/policy.h"

namespace frugal::distributed {

struct DataParallelOptions {
  /// Gradients travel in buckets of about this many bytes, each sent as soon as all its
  /// gradients are ready, while backward goes on (PyTorch DDP's bucket_cap_mb, 25 MiB).
  TORCH_ARG(std::int64_t, bucket_bytes) = std::int64_t{25} << 20;
  /// Copy rank 0's buffers (BatchNorm's running statistics) to every rank at each step's
  /// start, as DDP's broadcast_buffers does.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Report the loss of the global batch (every rank's samples), one small all-reduce a
  /// batch; off, each rank reports its own.
  TORCH_ARG(bool, global_loss) = true;
};

/// Averages gradients over the ranks of `group` so that every rank takes the step one
/// process would take on the union of the ranks' batches. Parameters and buffers are copied
/// from rank 0 when the policy is added; from then on the ranks stay identical.
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
  const std::vector<std::vector<std::size_t>>& buckets() const { return buckets_; }
  /// The global count of the last optimizer step (all ranks' window counts summed).
  std::int64_t last_global_count() const { return global_count_; }

 private:
  void launch_ready(StepContext& ctx);
  void launch(std::size_t bucket, StepContext& ctx);
  void finish(std::size_t bucket);
  void reset();

  std::shared_ptr<Group> group_;
  DataParallelOptions options_;
  std::vector<torch::Tensor> params_;                   // the optimizer's, in order
  std::unordered_map<const void*, std::size_t> index_;  // TensorImpl -> position in params_
  std::vector<std::size_t> bucket_of_;                  // position -> bucket
  std::vector<std::vector<std::size_t>> buckets_;
  std::vector<std::int64_t> numel_;  // per parameter, read when added
  std::vector<std::int64_t> bucket_numel_;
  // The step in flight.
  std::vector<std::size_t> missing_;  // per bucket: gradients not delivered yet
  std::size_t next_ = 0;              // the next bucket to send
  std::size_t finished_ = 0;          // buckets back and handed out, in order
  double weight_ = 0;                 // this rank's count / the global count
  std::int64_t global_count_ = 0;
  std::vector<torch::Tensor> flats_;
  torch::Tensor flags_;      // per parameter: 1 where this rank had a gradient
  torch::Tensor flags_cpu_;  // the ranks' sum, read once a step
  std::vector<Work> works_;
  optim::ShardedOptimizer* keeper_ = nullptr;  // gradients go to its shard, not the parameters
  bool shards_ = false;                        // the keeper shards the parameters too (stage 3)
  bool updates_ = false;  // the keeper updates its shares in backward (told when it may)
  bool begun_ = false;    // one rank, updates_: the keeper was told this step's gradients come
  bool in_step_ = false;  // between a step's begin and its end: set when a step failed
};

}  // namespace frugal::distributed
