// ZeRO stages 1, 2 and 3: each rank keeps the optimizer state (stage 2: and the gradients;
// stage 3: and the weights between steps) of its 1/N of the parameters only.
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <vector>

#include "frugal/distributed/group.h"
#include "frugal/memory/ledger.h"
#include "frugal/optim/sharded.h"

namespace frugal::optim {
class InPlaceOptimizer;
}  // namespace frugal::optim

namespace frugal::distributed {
namespace detail {
struct ZeroLayout;
class ZeroUnitHooks;
}  // namespace detail

struct ZeroOptimizerOptions {
  /// 1: the optimizer state is sharded; every rank holds every (averaged) gradient.
  /// 2: the gradients too: DataParallel keeps each bucket's part this rank owns and frees
  /// the rest as soon as the bucket has been averaged.
  /// 3: the weights too: between steps each rank holds its range of them only; they are
  /// gathered whole when a step (or an evaluation) begins and freed when the backward that
  /// completes the step has delivered its gradients, before the optimizer step.
  TORCH_ARG(int, stage) = 1;
  /// The all-gather after the step moves the ranges in pieces of at most this many bytes
  /// (all ranks' pieces together), so its buffer stays small.
  TORCH_ARG(std::int64_t, gather_bytes) = std::int64_t{8} << 20;
  /// Stage 3: modules whose parameters are gathered and released as one unit each, around
  /// every call of the module through frugal::nn::call (before its forward, and again
  /// before its backward), so that one unit at a time is whole instead of the model. The
  /// other parameters form the root unit, whole from a step's start to its optimizer step.
  /// Units must not share parameters; a unit's forward must be reached through
  /// frugal::nn::call, or it reads empty parameters (a shape error).
  TORCH_ARG(std::vector<std::shared_ptr<torch::nn::Module>>, units) = {};
  /// With units: while a unit computes, the next one's all-gather is already under way (the
  /// next in the last forward's order in a forward, the one before it in backward), one
  /// unit ahead at most; it costs one more unit's whole weights at a time.
  TORCH_ARG(bool, prefetch) = true;
  /// Stage 3: each unit's range is updated during backward, as soon as the ranks have
  /// averaged every gradient of the unit, and its gradients go at once (the optimizer step
  /// in backward, on the shards): a rank holds the gradients of the units in flight, not
  /// its range of all of them. Needs one of frugal's optimizers (frugal::optim::SGD, Adam,
  /// AdamW, Adam8bit, AdamW8bit), which `make` gets with one parameter a unit (its range).
  /// With DataParallel, a NaN or infinite loss on any rank skips the step on every rank
  /// before anything changes; a failure after the first update leaves the ranks out of step.
  TORCH_ARG(bool, step_in_backward) = false;
  /// Stage 3: the dtype units are gathered in for the forward and backward (FSDP's
  /// `param_dtype`), e.g. torch::kBFloat16: each rank's range stays in the parameters'
  /// dtype (float32: the weights the optimizer updates), and each gather rounds it to this
  /// dtype, so a unit whole costs 2 bytes an element instead of 4 and bf16 autocast has no
  /// weight to cast. The parameters take this dtype when the optimizer is built (build it
  /// before anything hooks them) and keep it: their gradients have it, DataParallel
  /// averages them in it, and the owned part is kept in the range's dtype. Run the forward
  /// under autocast of this dtype (frugal::use_mixed_precision) or feed it inputs of this
  /// dtype; GatheredParameters gives the weights in it. Unset: the parameters' dtype.
  TORCH_ARG(c10::optional<torch::Dtype>, param_dtype) = c10::nullopt;
  /// Stage 3: each rank's range of each unit is stored as 8-bit codes (per group of
  /// `int8_group` elements a byte each, with a bfloat16 zero point and scale: 1.03 bytes an
  /// element for 128, as nn::Int8Weights stores a module's matrices) instead of in the
  /// parameters' dtype. A gather decodes this rank's range into its place (in param_dtype);
  /// the optimizer, which must be one of frugal's (frugal::optim::SGD, Adam, AdamW,
  /// Adam8bit, ...), updates the codes of each unit's range, rounded as its
  /// InPlaceOptions::rounding says (stochastic: small updates survive in expectation; the
  /// random bits saved, so a resumed run is bit-exact). The ledger counts the codes and
  /// statistics as weights; a saved state holds them.
  TORCH_ARG(bool, int8_ranges) = false;
  TORCH_ARG(std::int64_t, int8_group) = 128;
};

/// An optimizer sharded over the ranks of `group` (ZeRO, Rajbhandari et al. 2019; PyTorch's
/// ZeroRedundancyOptimizer shards whole parameters, this one a flat buffer, so every rank
/// holds the same share). The parameters move into one flat buffer, in order, padded to a
/// multiple of N (the same tensors: names, hooks and the model's state dict are unchanged;
/// do not move the model to another device afterwards), cut in N equal ranges; `make`
/// builds the optimizer that does the work over rank r's range, a view of that buffer, so
/// its state holds 1/N of the elements and it updates the parameters in place. After that
/// step the ranks all-gather the ranges into every rank's parameters, in pieces of
/// `gather_bytes`.
///
/// fp32 Adam holds 16 bytes a parameter (weights 4, gradients 4, state 8); stage 1 keeps
/// 8 + 8/N of them, stage 2 4 + 12/N, stage 3 16/N between steps (DeepSpeed's ZeRO-3 and
/// FSDP's full sharding). Stage 3 gathers the whole model once a step, or, with
/// `units`, one module at a time around its calls (FSDP's wrapped modules).
///
/// Stage 3: the range is a tensor of its own and the flat buffer exists only while the
/// parameters are whole; released, every parameter is an empty tensor (same object, name
/// and hooks; 0 elements), so reading the model between steps fails loudly rather than
/// reading stale values. Read, evaluate or save whole weights inside a
/// frugal::optim::GatheredParameters (Trainer::evaluate gathers by itself). Building the
/// optimizer copies rank 0's weights to every rank, collectively. Use it as the trainer's
/// optimizer, with a DataParallel policy over the same group. The update must be elementwise (SGD,
/// Adam, AdamW, frugal's in-place and 8-bit ones; the 8-bit states quantize blocks of the flat
/// range). One parameter group, one dtype; a parameter without a gradient on any rank is
/// stepped with a zero gradient, as DDP does with unused parameters.
///
/// A failure in the shard's update leaves everything as it was (with frugal's optimizers);
/// one during the all-gather leaves the ranks out of step (DataParallel then refuses further
/// steps; restart from a saved state). A saved training state holds this rank's shard:
/// every rank saves its own (fit does, in save_dir/rank-R) and loads only its own.
///
/// Example:
///   auto zero = std::make_shared<frugal::distributed::ZeroOptimizer>(
///       model->parameters(), group,
///       [](std::vector<torch::Tensor> shard) {
///         return std::make_unique<frugal::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
///       },
///       frugal::distributed::ZeroOptimizerOptions().stage(2));
///   frugal::Trainer trainer(model, *zero, loss_fn);
///   trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(group));
class ZeroOptimizer : public torch::optim::Optimizer,
                      public LedgerParts,
                      public optim::ShardedOptimizer {
 public:
  using Factory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> shard)>;
  ZeroOptimizer(std::vector<torch::Tensor> params, std::shared_ptr<Group> group, Factory make,
                ZeroOptimizerOptions options = {});
  ~ZeroOptimizer() override;

  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  int stage() const { return options_.stage(); }
  /// Without units: this rank's range of the flat parameters starts here and has
  /// shard_size() elements (the padding included). With units, the shard holds this rank's
  /// range of each unit in turn.
  std::int64_t shard_begin() const { return group_->rank() * shard_size_; }
  std::int64_t shard_size() const { return shard_size_; }
  /// The optimizer that updates this rank's range.
  torch::optim::Optimizer& inner() { return *inner_; }
  /// Stage 2: Trait::KeepsGradients; stage 3: and Trait::ShardsParameters.
  Traits traits() const override;
  /// Stage 3: every rank's range into a new flat buffer the parameters view (collective).
  void gather_parameters() override;
  /// Stage 3: the root unit only when there are units (they gather themselves when called).
  void gather_for_forward() override;
  /// Stage 3: the flat buffer and the parameters' gradients go; the parameters are emptied.
  void release_parameters() override;
  bool parameters_whole() const override;
  std::int64_t whole_numel(const torch::Tensor& param) const override;
  /// Stage 2: the part of `param`'s averaged gradient (`grad`, flat) that this rank owns
  /// goes into the range's gradient; DataParallel calls it once per parameter and step.
  void keep_gradient(const torch::Tensor& param, const torch::Tensor& grad) override;
  /// Drops a skipped step's kept gradients; with step_in_backward, whether units may be
  /// updated as their gradients complete.
  void begin_gradients(bool will_step) override;

  std::vector<torch::Tensor> ledger_weights() const override;
  std::vector<torch::Tensor> ledger_gradients() const override;
  std::vector<torch::Tensor> ledger_optimizer_state() const override;

 private:
  struct Parts;
  bool apart() const;  // whether each unit's range is a tensor of its own
  static Parts build(std::vector<torch::Tensor> params, const std::shared_ptr<Group>& group,
                     const Factory& make, const ZeroOptimizerOptions& options);
  ZeroOptimizer(Parts parts, std::shared_ptr<Group> group, ZeroOptimizerOptions options);
  void gather_owned_gradient();
  void sync_inner_options();
  torch::Tensor step_rest();  // step_in_backward: the units backward did not update
  // step_in_backward: updates unit `u`'s range and frees its gradient.
  void step_unit(std::size_t u);

  std::shared_ptr<detail::ZeroLayout> layout_;
  std::shared_ptr<Group> group_;
  ZeroOptimizerOptions options_;
  std::int64_t shard_size_ = 0;
  torch::Tensor shard_;  // this rank's range
  // The inner optimizer's parameters: the shard, or with step_in_backward each unit's range
  // of it (a view).
  std::vector<torch::Tensor> targets_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
  optim::InPlaceOptimizer* in_place_ = nullptr;  // step_in_backward: steps one unit's range
  struct Progress {                              // step_in_backward, this step's
    std::vector<std::size_t> kept;               // gradients kept, a unit
    std::vector<std::size_t> needed;             // ... that complete it
    std::vector<bool> stepped;
    bool may_update = false;
    bool any = false;  // some gradient was kept
  } progress_;
  std::unique_ptr<detail::ZeroUnitHooks> hooks_;  // stage 3 with units
};

}  // namespace frugal::distributed
