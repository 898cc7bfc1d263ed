// Where the fit loop takes its samples: tensors in memory, or a LibTorch dataset.
#pragma once

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "frugal/train/batch.h"
#include "frugal/error.h"

namespace frugal {

/// A set of `size()` samples of which any subset can be fetched as one Batch. The fit loop
/// does the shuffling and batching itself (from its seed), so that a resumed run meets the
/// same batches in the same order.
class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual std::int64_t size() const = 0;
  /// The samples at `indices` (a 1-D int64 tensor) as one batch, in that order.
  virtual Batch get(const torch::Tensor& indices) const = 0;
};

/// All samples held as tensors: `all.inputs` (and `all.targets`) indexed along dimension 0.
///
/// Example:
///   frugal::TensorData train({images, labels});
class TensorData : public DataSource {
 public:
  explicit TensorData(Batch all);
  std::int64_t size() const override { return size_; }
  Batch get(const torch::Tensor& indices) const override;

 private:
  Batch all_;
  std::int64_t size_;
};

/// A LibTorch map-style dataset (torch::data::datasets::MNIST, a custom Dataset, one with
/// .map() transforms): its get_batch() is called with the indices, and a vector of
/// examples is stacked into one batch (a Stack transform's example is used as it is).
///
/// Example:
///   auto mnist = torch::data::datasets::MNIST(root).map(torch::data::transforms::Stack<>());
///   frugal::TorchDataset<decltype(mnist)> train(std::move(mnist));
template <typename Dataset>
class TorchDataset : public DataSource {
 public:
  explicit TorchDataset(Dataset dataset) : dataset_(std::move(dataset)) {
    const auto n = dataset_.size();
    FRUGAL_CHECK(n.has_value(), "frugal: TorchDataset needs a dataset of known size");
    size_ = static_cast<std::int64_t>(*n);
  }
  std::int64_t size() const override { return size_; }
  Batch get(const torch::Tensor& indices) const override {
    const auto idx = indices.to(torch::kLong).contiguous();
    std::vector<std::size_t> request(static_cast<std::size_t>(idx.numel()));
    const auto* data = idx.data_ptr<std::int64_t>();
    for (std::size_t i = 0; i < request.size(); ++i) {
      request[i] = static_cast<std::size_t>(data[i]);
    }
    return to_batch(dataset_.get_batch(request));
  }

 private:
  mutable Dataset dataset_;  // LibTorch's get_batch() is not const
  std::int64_t size_ = 0;
};

}  // namespace frugal
