// A chain of unequal blocks, for choosing which to checkpoint: dense blocks that compute
// much and keep little, and gate blocks that compute little and keep much.
#pragma once

#include <torch/torch.h>

namespace models {

/// x + fc2(relu(fc1(x))), square: two matrix products, two activations kept.
class DenseBlockImpl : public torch::nn::Module {
 public:
  explicit DenseBlockImpl(std::int64_t width)
      : fc1(register_module("fc1", torch::nn::Linear(width, width))),
        fc2(register_module("fc2", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::relu(fc1(x))); }

  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(DenseBlock);

/// `steps` times y = y * sigmoid(y) + 0.1 * tanh(y): elementwise work whose intermediates
/// (four of the input's size a step) are kept for backward.
class GateBlockImpl : public torch::nn::Module {
 public:
  explicit GateBlockImpl(int steps) : steps_(steps) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = x;
    for (int i = 0; i < steps_; ++i) {
      y = y * torch::sigmoid(y) + 0.1 * torch::tanh(y);
    }
    return y;
  }

 private:
  int steps_;
};
TORCH_MODULE(GateBlock);

/// `pairs` of (DenseBlock, GateBlock), then a linear head to `outputs`, as one Sequential.
inline torch::nn::Sequential make_mixed_chain(std::int64_t pairs, std::int64_t width,
                                              int gate_steps, std::int64_t outputs) {
  torch::nn::Sequential seq;
  for (std::int64_t i = 0; i < pairs; ++i) {
    seq->push_back(DenseBlock(width));
    seq->push_back(GateBlock(gate_steps));
  }
  seq->push_back(torch::nn::Linear(width, outputs));
  return seq;
}

}  // namespace models
