// A small model of units for the LoRA and frozen-weights tests: blocks of three Linear
// layers called through frugal::nn::call, and a head outside them.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "frugal/nn/checkpoint.h"

namespace frugal::testing {

constexpr std::int64_t kDim = 6;

struct LoraBlockImpl : torch::nn::Module {
  /// own_calls: the block calls its layers through frugal::nn::call (as LoRA with dropout
  /// needs), not directly.
  explicit LoraBlockImpl(bool own_calls = false) : own_calls(own_calls) {
    attn = register_module("attn", torch::nn::Linear(kDim, kDim));
    up = register_module("up", torch::nn::Linear(kDim, 2 * kDim));
    down = register_module("down", torch::nn::Linear(2 * kDim, kDim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + torch::tanh(run(attn, x));
    seen = attn->weight;  // the weight this run read
    return h + run(down, torch::tanh(run(up, h)));
  }
  torch::Tensor run(torch::nn::Linear& layer, const torch::Tensor& x) {
    return own_calls ? frugal::nn::call(layer, x) : layer(x);
  }
  bool own_calls;
  torch::nn::Linear attn{nullptr}, up{nullptr}, down{nullptr};
  torch::Tensor seen;
};
TORCH_MODULE(LoraBlock);

struct LoraNetImpl : torch::nn::Module {
  explicit LoraNetImpl(int blocks = 3, bool own_calls = false) {
    torch::manual_seed(11);
    for (int i = 0; i < blocks; ++i) {
      list->push_back(LoraBlock(own_calls));
    }
    register_module("blocks", list);
    head = register_module("head", torch::nn::Linear(kDim, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < list->size(); ++i) {
      x = frugal::nn::call(list->ptr<LoraBlockImpl>(i), x);
    }
    return head(x);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units() { return list->children(); }
  torch::nn::ModuleList list;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(LoraNet);

/// Every Linear weight of the blocks replaced by `decode(weight)`.
inline void replace_block_weights(
    LoraNet& net, const std::function<torch::Tensor(const torch::Tensor&)>& decode) {
  torch::NoGradGuard no_grad;
  for (auto& unit : net->units()) {
    for (auto& m : unit->modules()) {
      if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(m.get())) {
        l->weight.copy_(decode(l->weight));
      }
    }
  }
}

/// After a forward of `net` on an input that requires grad: the weight each block's run read
/// holds no bytes while autograd keeps it for backward; a checkpointed forward keeps nothing
/// (the weight was made without a graph, and only the block's `seen` holds it).
inline void expect_weights_wait_for_backward(LoraNet& net, bool checkpointed) {
  for (std::size_t i = 0; i < net->list->size(); ++i) {
    const auto& seen = net->list->ptr<LoraBlockImpl>(i)->seen;
    if (checkpointed) {
      EXPECT_FALSE(seen.requires_grad()) << i;
    } else {
      EXPECT_EQ(seen.storage().nbytes(), 0U) << i;
    }
  }
}

}  // namespace frugal::testing
