// The one gradient reducer of data parallelism: buckets sent while backward goes on, for the
// Trainer's DataParallel and frugal::Loop alike.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/optim/sharded.h"
#include "frugal/train/reducer.h"

namespace frugal::distributed {

struct ReducerOptions {
  /// Gradients travel in buckets of about this many bytes, each sent as soon as all its
  /// gradients are ready, while backward goes on (PyTorch DDP's bucket_cap_mb, 25 MiB).
  TORCH_ARG(std::int64_t, bucket_bytes) = std::int64_t{25} << 20;
  /// Copy rank 0's buffers (BatchNorm's running statistics) to every rank at each step's
  /// start, as DDP's broadcast_buffers does.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// The Loop reports each model's loss as the mean over the ranks (one small all-reduce at
  /// Loop::end, as DataParallelOptions::global_loss does for the Trainer); off, each rank
  /// reports its own.
  TORCH_ARG(bool, global_loss) = true;
};

/// Averages one model's gradients over the ranks of a group, weighted by each rank's count
/// over the sum of all ranks' counts. Gradients are packed into buckets in reverse parameter
/// order (backward produces the last layers' first); a bucket is sent as soon as all its
/// gradients were added, in the same order on every rank whatever order they came in. The
/// first bucket of a step waits for the ranks' counts summed (on the device: the host does
/// not wait), which weigh every bucket; finalize agrees on a non-finite loss and returns both.
/// A keeper (ZeRO stage 2 and 3) must know before its first update whether the step will be
/// skipped: the first bucket then agrees on both on the host.
///
/// Under a ShardedOptimizer with Trait::KeepsGradients (ZeRO stage 2 and 3) each averaged
/// bucket leaves only the part this rank owns and is freed; under stage 3 the parameters are
/// gathered for the forward by begin() and released by finalize(). Built by attaching:
/// every rank starts from rank 0's weights and buffers.
class BucketReducer : public ModelReducer {
 public:
  BucketReducer(std::shared_ptr<Group> group, ReducerOptions options, torch::nn::Module& module,
                torch::optim::Optimizer& optimizer);
  void begin() override;
  void add(const torch::Tensor& param, const ReduceShare& share) override;
  ReduceResult finalize(const ReduceShare& share) override;
  bool keeps_gradients() const override { return keeper_ != nullptr; }
  bool agrees_in_backward() const override { return keeper_ != nullptr; }
  double global_loss(double loss) override;

  /// Stage 3: what a forward needs whole, without the step's communication (a trial step).
  void gather_for_forward();
  const Group& group() const { return *group_; }
  /// Parameter indices (in the optimizer's order) of each bucket, in sending order.
  const std::vector<std::vector<std::size_t>>& buckets() const { return buckets_; }
  /// The global count of the last step (all ranks' counts summed).
  std::int64_t last_global_count() const { return global_count_; }

 private:
  void launch_ready(const ReduceShare& share);
  void launch(std::size_t bucket, const ReduceShare& share);
  void finish(std::size_t bucket);
  void reset();

  std::shared_ptr<Group> group_;
  ReducerOptions options_;
  torch::nn::Module& module_;
  std::vector<torch::Tensor> params_;                   // the optimizer's, in order
  std::unordered_map<const void*, std::size_t> index_;  // TensorImpl -> position in params_
  std::vector<std::size_t> bucket_of_;                  // position -> bucket
  std::vector<std::vector<std::size_t>> buckets_;
  std::vector<std::int64_t> numel_;  // per parameter, read when attached
  std::vector<std::int64_t> bucket_numel_;
  // The step in flight.
  std::vector<std::size_t> missing_;  // per bucket: gradients not added yet
  std::size_t next_ = 0;              // the next bucket to send
  std::size_t finished_ = 0;          // buckets back and handed out, in order
  bool agreed_ = false;               // the step's first bucket has left
  double weight_ = 0;                 // this rank's count / the global count (a keeper's)
  torch::Tensor weight_on_device_;    // the same, computed on the device (no keeper)
  torch::Tensor agreement_;           // the ranks' counts summed on the device (no keeper)
  std::int64_t global_count_ = 0;
  std::vector<torch::Tensor> flats_;
  torch::Tensor flags_;      // per parameter: 1 where this rank had a gradient
  torch::Tensor flags_cpu_;  // the ranks' sum, read once a step
  std::vector<Work> works_;
  optim::ShardedOptimizer* keeper_ = nullptr;  // gradients go to its shard, not the parameters
  bool shards_ = false;                        // the keeper shards the parameters too (stage 3)
  bool updates_ = false;  // the keeper updates its shares in backward (told when it may)
  bool begun_ = false;    // one rank, updates_: the keeper was told this step's gradients come
};

/// The reducer frugal::Loop attaches to each model it prepares: a BucketReducer over `group`.
/// Each process backpropagates the mean loss of an equal share of the batch (the count of a
/// share is 1); the reduction of a model's gradients overlaps the backward that ends its step
/// (every backward outside Loop::no_sync, and the last micro-batch of Loop::accumulate).
///
/// Example:
///   auto group =
///   frugal::distributed::Group::join(frugal::distributed::LaunchEnv::from_environment());
///   frugal::Loop loop(frugal::LoopOptions().reducer(
///       std::make_shared<frugal::distributed::Reducer>(group)));
class Reducer : public GradientReducer {
 public:
  explicit Reducer(std::shared_ptr<Group> group, ReducerOptions options = {});
  std::unique_ptr<ModelReducer> attach(torch::nn::Module& module,
                                       torch::optim::Optimizer& optimizer) override;
  const Group& group() const { return *group_; }

 private:
  std::shared_ptr<Group> group_;
  ReducerOptions options_;
};

}  // namespace frugal::distributed
