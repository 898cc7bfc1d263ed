// The two Fashion-MNIST models of the example: the dataset's reference CNN and an MLP.
// Each is a Sequential of blocks, so that `--checkpoint` can checkpoint the blocks.
#pragma once

#include <torch/torch.h>

namespace fashion {

/// A Sequential with a plain Tensor forward, so it can sit in another Sequential (and be
/// checkpointed as a block).
class BlockImpl : public torch::nn::SequentialImpl {
 public:
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Block);

/// conv 5x5x32, 2x2 max-pool, conv 5x5x64, 2x2 max-pool ("same" padding, so the dense
/// layer sees 7x7x64), dense 1024 with ReLU, dropout, dense 10.
inline torch::nn::Sequential make_cnn(double dropout) {
  namespace nn = torch::nn;
  return nn::Sequential(
      Block(nn::Conv2d(nn::Conv2dOptions(1, 32, 5).padding(2)), nn::ReLU(),
                     nn::MaxPool2d(2)),
      Block(nn::Conv2d(nn::Conv2dOptions(32, 64, 5).padding(2)), nn::ReLU(),
                     nn::MaxPool2d(2)),
      Block(nn::Flatten(), nn::Linear(7 * 7 * 64, 1024), nn::ReLU(),
                     nn::Dropout(dropout)),
      nn::Linear(1024, 10));
}

/// 784 -> 512 -> 256 -> 10 with ReLU and dropout.
inline torch::nn::Sequential make_mlp(double dropout) {
  namespace nn = torch::nn;
  return nn::Sequential(
      Block(nn::Flatten(), nn::Linear(784, 512), nn::ReLU(), nn::Dropout(dropout)),
      Block(nn::Linear(512, 256), nn::ReLU(), nn::Dropout(dropout)), nn::Linear(256, 10));
}

/// `model` with bfloat16 weights: its inputs cast to bfloat16 on the way in and its
/// outputs to float32 on the way out (the loss and the accuracy in float32).
inline torch::nn::Sequential with_bf16_weights(const torch::nn::Sequential& model) {
  namespace nn = torch::nn;
  nn::Sequential out(nn::Functional([](torch::Tensor x) { return x.to(torch::kBFloat16); }));
  for (const auto& layer : *model) {
    out->push_back(layer);
  }
  out->push_back(nn::Functional([](torch::Tensor x) { return x.to(torch::kFloat32); }));
  out->to(torch::kBFloat16);
  return out;
}

}  // namespace fashion
