// The names README.md's C++ snippets take as given, for compiling them (never run).
#pragma once

#include <fmt/core.h>
#include <frugal/distributed.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

// The README's example block: Block(512, 2048), and ResidualBlock by type name.
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t width, std::int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(width, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

namespace readme {

struct Given {
  torch::Tensor images, labels, test_images, test_labels, x, loss, tokens, next_tokens,
      padding_mask;
  std::vector<torch::Tensor> params;
  frugal::Batch sample_batch, worst_case_batch, global_batch, test_set;
  torch::nn::Sequential model, seq;
  Block block{nullptr};
  torch::optim::Optimizer& optimizer;
  torch::optim::Adam& adam;
  frugal::Trainer& trainer;
  frugal::Trainer::LossFn loss_fn;
};

}  // namespace readme
