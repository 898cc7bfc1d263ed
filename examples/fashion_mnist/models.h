// The two Fashion-MNIST models of the example: the dataset's reference CNN and an MLP.
#pragma once

#include <torch/torch.h>

namespace fashion {

/// conv 5x5x32, 2x2 max-pool, conv 5x5x64, 2x2 max-pool ("same" padding, so the dense
/// layer sees 7x7x64), dense 1024 with ReLU, dropout, dense 10.
inline torch::nn::Sequential make_cnn(double dropout) {
  namespace nn = torch::nn;
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(1, 32, 5).padding(2)), nn::ReLU(), nn::MaxPool2d(2),
      nn::Conv2d(nn::Conv2dOptions(32, 64, 5).padding(2)), nn::ReLU(), nn::MaxPool2d(2),
      nn::Flatten(), nn::Linear(7 * 7 * 64, 1024), nn::ReLU(), nn::Dropout(dropout),
      nn::Linear(1024, 10));
}

/// 784 -> 512 -> 256 -> 10 with ReLU and dropout.
inline torch::nn::Sequential make_mlp(double dropout) {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Flatten(), nn::Linear(784, 512), nn::ReLU(), nn::Dropout(dropout),
                        nn::Linear(512, 256), nn::ReLU(), nn::Dropout(dropout),
                        nn::Linear(256, 10));
}

}  // namespace fashion
