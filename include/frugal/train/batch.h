// A batch of samples: inputs, targets and any other named tensors, split along the first
// dimension.
#pragma once

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace frugal {

/// Tensors whose first dimension is the sample dimension: `inputs` and `targets` for the
/// easy path, and any number of other named tensors (masks, positions, lengths, a second
/// input) that a model's forward or a loss takes. Micro-batches slice all of them alike.
///
/// Example:
///   frugal::Batch batch{images, labels};
///   auto first_half = batch.slice(0, batch.size() / 2);
///   frugal::Batch lm{tokens, next_tokens};
///   lm.set("mask", padding_mask).set("positions", positions);
///   auto mask = lm.get("mask");  // in a forward or loss callable, of the micro-batch
struct Batch {
  torch::Tensor inputs;   ///< may be undefined when named tensors carry everything
  torch::Tensor targets;  ///< may be undefined when the loss needs none
  /// Named tensors besides inputs and targets, in the order they were set.
  std::vector<std::pair<std::string, torch::Tensor>> fields;

  Batch() = default;
  /// Inputs alone (the loss needs no targets).
  explicit Batch(torch::Tensor inputs) : inputs(std::move(inputs)) {}
  /// Inputs and targets: `trainer.step({images, labels})`.
  Batch(torch::Tensor inputs, torch::Tensor targets)
      : inputs(std::move(inputs)), targets(std::move(targets)) {}

  /// Sets (or replaces) the named tensor `name`; "inputs" and "targets" name the members.
  Batch& set(const std::string& name, torch::Tensor tensor);
  /// The named tensor; an error names the missing one and those the batch holds.
  const torch::Tensor& get(const std::string& name) const;
  bool has(const std::string& name) const;

  /// Samples in the batch; throws when there is no tensor, one is scalar, or two disagree
  /// (the error names both).
  std::int64_t size() const;
  /// Samples [start, start + length) of every tensor, as views.
  Batch slice(std::int64_t start, std::int64_t length) const;
  /// The batch on `device` (no copy of a tensor that is there already). From the host to
  /// a CUDA device the copies go through page-locked memory without blocking the host.
  Batch to(torch::Device device) const;
  /// For `device` a CUDA device: the batch with its host tensors in page-locked memory, once,
  /// so that each micro-batch's `to` copies from it without a page-locked block of its own;
  /// for any other device the batch itself.
  Batch pinned_for(torch::Device device) const;
};

/// A batch as LibTorch's data API yields it: an Example (a Stack transform's), a
/// TensorExample, or a vector of examples, stacked.
inline Batch to_batch(const Batch& batch) { return batch; }
template <typename Data, typename Target>
Batch to_batch(const torch::data::Example<Data, Target>& example) {
  if constexpr (std::is_same_v<Target, torch::data::example::NoTarget>) {
    return {example.data, torch::Tensor()};
  } else {
    return {example.data, example.target};
  }
}
template <typename Example>
Batch to_batch(const std::vector<Example>& examples) {
  std::vector<torch::Tensor> inputs, targets;
  for (const auto& example : examples) {
    const auto one = to_batch(example);
    inputs.push_back(one.inputs);
    if (one.targets.defined()) {
      targets.push_back(one.targets);
    }
  }
  return {torch::stack(inputs), targets.empty() ? torch::Tensor() : torch::stack(targets)};
}

}  // namespace frugal
