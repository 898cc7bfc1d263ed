// The residual MLP of the memory tour, the checkpoint tests and the benchmarks.
#pragma once

#include <torch/torch.h>

namespace models {

/// x + fc2(gelu(fc1(x))): a block whose activations (hidden-wide) dwarf its input.
class ResidualBlockImpl : public torch::nn::Module {
 public:
  ResidualBlockImpl(std::int64_t width, std::int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(width, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, width))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    return x + fc2(torch::gelu(fc1(x)));
  }

  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(ResidualBlock);

/// `blocks` residual blocks then a linear head to `outputs`, as one Sequential so that
/// blocks can be checkpointed by type or position.
inline torch::nn::Sequential make_residual_mlp(std::int64_t blocks, std::int64_t width,
                                               std::int64_t hidden, std::int64_t outputs) {
  torch::nn::Sequential seq;
  for (std::int64_t i = 0; i < blocks; ++i) {
    seq->push_back(ResidualBlock(width, hidden));
  }
  seq->push_back(torch::nn::Linear(width, outputs));
  return seq;
}

}  // namespace models
