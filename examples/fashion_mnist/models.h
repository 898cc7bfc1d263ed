// The two Fashion-MNIST models of the example: the dataset's reference CNN and an MLP.
// Each is a Sequential of blocks, so that `--checkpoint` can checkpoint the blocks; and
// their bfloat16 and 8-bit-weight forms.
#pragma once

#include <frugal/frugal.h>
#include <torch/torch.h>

#include <functional>

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
      Block(nn::Conv2d(nn::Conv2dOptions(1, 32, 5).padding(2)), nn::ReLU(), nn::MaxPool2d(2)),
      Block(nn::Conv2d(nn::Conv2dOptions(32, 64, 5).padding(2)), nn::ReLU(), nn::MaxPool2d(2)),
      Block(nn::Flatten(), nn::Linear(7 * 7 * 64, 1024), nn::ReLU(), nn::Dropout(dropout)),
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

/// A layer of a Sequential that reaches the layer it holds (registered as "layer") through
/// frugal::nn::call, where the hook of an Int8Weights unit materialises its weights for
/// the call.
class UnitLayerImpl : public torch::nn::Module {
 public:
  template <typename Layer>
  explicit UnitLayerImpl(const Layer& layer)
      : call_([layer](const torch::Tensor& x) { return frugal::nn::call(layer, x); }) {
    register_module("layer", layer);
  }
  torch::Tensor forward(const torch::Tensor& x) { return call_(x); }

 private:
  std::function<torch::Tensor(const torch::Tensor&)> call_;
};
TORCH_MODULE(UnitLayer);

/// `model` with its matrices in 8 bits: each block and each Linear layer a unit of `int8`
/// (its large matrices as codes, materialised in the store's dtype while it runs; the
/// rest, and the small convolution, in that dtype); inputs cast to that dtype on the way
/// in and outputs to float32 on the way out.
inline torch::nn::Sequential with_int8_weights(const torch::nn::Sequential& model,
                                               frugal::nn::Int8Weights& int8) {
  namespace nn = torch::nn;
  const auto dtype = int8.options().dtype().value_or(torch::kFloat);
  nn::Sequential out(nn::Functional([dtype](torch::Tensor x) { return x.to(dtype); }));
  for (const auto& layer : *model) {
    if (auto block = std::dynamic_pointer_cast<BlockImpl>(layer.ptr())) {
      out->push_back(UnitLayer(int8.add(block)));
    } else if (auto linear = std::dynamic_pointer_cast<nn::LinearImpl>(layer.ptr())) {
      out->push_back(UnitLayer(int8.add(linear)));
    } else {
      out->push_back(layer);
    }
  }
  out->push_back(nn::Functional([](torch::Tensor x) { return x.to(torch::kFloat32); }));
  return out;
}

}  // namespace fashion
