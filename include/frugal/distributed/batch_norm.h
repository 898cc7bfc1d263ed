// BatchNorm whose batch statistics are those of the whole batch over a process group.
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstddef>
#include <memory>
#include <ostream>

#include "frugal/distributed/group.h"

namespace frugal::distributed {

/// BatchNorm over inputs of shape (N, C, ...) — BatchNorm1d, 2d and 3d in one — that, once
/// given a group of more than one rank, normalizes each rank's share of a batch by the mean
/// and variance of the whole batch: the per-channel sums are all-reduced in forward (two small
/// all-reduces: the sums, then the squared deviations from the common mean) and the gradient
/// sums in backward, so every rank's output, input gradient and running statistics are what
/// one process given the whole batch computes (PyTorch's nn.SyncBatchNorm). The parameters'
/// gradients stay each rank's own, for the reducer that averages every other gradient.
///
/// Without a group, or with a group of one, it is torch::nn::BatchNorm: the same parameters,
/// buffers, names, initial values and forward, bit for bit, so one model definition serves
/// one process and many. In eval mode with running statistics it normalizes by those, on each
/// rank alone, as BatchNorm does. Every rank must run the same forwards and backwards of it
/// (the collectives are issued in that order), as every rank of data-parallel training does.
///
/// Example:
///   struct NetImpl : torch::nn::Module {
///     torch::nn::Conv2d conv{register_module("conv", torch::nn::Conv2d(1, 8, 3))};
///     frugal::distributed::SyncBatchNorm bn{register_module(
///         "bn", frugal::distributed::SyncBatchNorm(torch::nn::BatchNormOptions(8)))};
///     torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
///   };
///   frugal::distributed::synchronize_batch_norm(*net, group);  // under torchrun
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(std::int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                             std::shared_ptr<Group> group = nullptr);

  torch::Tensor forward(const torch::Tensor& input);

  /// The ranks whose batches it normalizes together (nullptr: this process alone).
  void set_group(std::shared_ptr<Group> group) {
    group_ = std::move(group);
    channels_agreed_ = false;
  }
  const std::shared_ptr<Group>& group() const { return group_; }

  /// As torch::nn::BatchNorm's: registers the parameters and buffers, at their initial values.
  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  void check_input(const torch::Tensor& input) const;
  // Once a group: every rank's layer has as many channels as this one (else the statistics'
  // all-reduce would fail inside the backend, with no word of which layer).
  void agree_on_channels();

  std::shared_ptr<Group> group_;
  bool channels_agreed_ = false;
};
TORCH_MODULE(SyncBatchNorm);

/// Gives `group` to every SyncBatchNorm in `module`'s tree, `module` included (as
/// nn.SyncBatchNorm.convert_sync_batchnorm's process_group); returns how many it reached.
std::size_t synchronize_batch_norm(torch::nn::Module& module, std::shared_ptr<Group> group);

}  // namespace frugal::distributed
