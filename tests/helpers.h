// Small models and comparisons shared by the tests.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

/// Skips a `gpu`-labelled test, with a message, where CUDA is not available.
#define FRUGAL_SKIP_WITHOUT_CUDA()                          \
  if (!torch::cuda::is_available()) {                       \
    GTEST_SKIP() << "CUDA is not available on this machine"; \
  }

namespace frugal::testing {

/// A deterministic MLP (no dropout): the same seed gives the same weights.
inline torch::nn::Sequential make_mlp(std::int64_t in, std::int64_t hidden, std::int64_t out,
                                      std::uint64_t seed = 7) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::Tanh(),
                               torch::nn::Linear(hidden, out));
}

inline std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  for (const auto& t : tensors) {
    out.push_back(t.defined() ? t.detach().clone() : torch::Tensor());
  }
  return out;
}

inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    out.push_back(p.grad());
  }
  return clone_all(out);
}

inline void expect_all_close(const std::vector<torch::Tensor>& actual,
                             const std::vector<torch::Tensor>& expected, double rtol = 1e-5,
                             double atol = 1e-6) {
  ASSERT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(actual[i].defined()) << "tensor " << i << " is undefined";
    EXPECT_TRUE(torch::allclose(actual[i], expected[i], rtol, atol))
        << "tensor " << i << " differs by up to "
        << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

}  // namespace frugal::testing
