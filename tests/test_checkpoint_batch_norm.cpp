// Checkpointed blocks with batch-statistics layers: the recompute in backward leaves
// BatchNorm's running statistics and batch counter as one plain forward left them.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/checkpoint.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/policy/checkpoint_policy.h"
#include "helpers.h"

namespace {
namespace batch_norm {  // helper names of its own in the unity build

using frugal::testing::grads_of;

torch::nn::Sequential dense_net() {
  torch::manual_seed(21);
  return torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::BatchNorm1d(16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 16),
                               torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 3));
}

torch::nn::Sequential conv_net() {
  torch::manual_seed(22);
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)),
                               torch::nn::BatchNorm2d(4), torch::nn::ReLU(),
                               torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)),
                               torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::Flatten(),
                               torch::nn::Linear(4 * 6 * 6, 3));
}

// Every buffer of the model (running means and variances, batch counters), by value.
std::vector<torch::Tensor> buffers_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& b : m.buffers()) {
    out.push_back(b.clone());
  }
  return out;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i])) << "tensor " << i;
  }
}

struct Trained {
  std::vector<torch::Tensor> buffers, grads;
};

// Three forward+backward passes in training mode, then the model's buffers and gradients.
template <typename Forward>
Trained train(torch::nn::Sequential net, const torch::Tensor& x, Forward forward) {
  for (int i = 0; i < 3; ++i) {
    forward(net, x * (i + 1)).pow(2).sum().backward();
  }
  return {buffers_of(*net), grads_of(*net)};
}

torch::Tensor plain(torch::nn::Sequential& net, const torch::Tensor& x) { return net->forward(x); }

std::int64_t batches_tracked(const torch::nn::Module& m) {
  return m.named_buffers()["1.num_batches_tracked"].item<std::int64_t>();
}

TEST(CheckpointBatchNorm, SequentialSegmentsLeaveRunningStatisticsAsPlainForwards) {
  const auto x = torch::randn({8, 12});
  const auto expected = train(dense_net(), x, plain);
  auto net = dense_net();
  const auto got = train(net, x, [](torch::nn::Sequential& n, const torch::Tensor& in) {
    return frugal::checkpoint_sequential(n, 3, in);
  });
  EXPECT_EQ(batches_tracked(*net), 3);  // once per forward, not once more per recompute
  expect_equal(got.buffers, expected.buffers);
  expect_equal(got.grads, expected.grads);
}

TEST(CheckpointBatchNorm, PolicyWrappedConvBlocksLeaveRunningStatisticsAsPlainForwards) {
  const auto x = torch::randn({5, 1, 6, 6});
  const auto expected = train(conv_net(), x, plain);
  auto net = conv_net();
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().types({"torch::nn::BatchNorm2d"}));
  EXPECT_EQ(policy.apply(*net).size(), 2u);
  const auto got = train(net, x, plain);
  expect_equal(got.buffers, expected.buffers);
  expect_equal(got.grads, expected.grads);
}

TEST(CheckpointBatchNorm, BlocksCalledThroughNnCallLeaveRunningStatisticsAsPlainForwards) {
  struct NetImpl : torch::nn::Module {
    NetImpl() {
      torch::manual_seed(23);
      block = register_module(
          "block", torch::nn::Sequential(torch::nn::Linear(6, 6), torch::nn::BatchNorm1d(6)));
      head = register_module("head", torch::nn::Linear(6, 1));
    }
    torch::Tensor forward(const torch::Tensor& x) { return head(frugal::nn::call(block, x)); }
    torch::nn::Sequential block{nullptr};
    torch::nn::Linear head{nullptr};
  };
  auto run = [](bool checkpointed) {
    auto net = std::make_shared<NetImpl>();
    frugal::CheckpointPolicy policy(frugal::CheckpointSelect().names({"block"}));
    if (checkpointed) {
      policy.apply(*net);
    }
    torch::manual_seed(24);
    for (int i = 0; i < 2; ++i) {
      net->forward(torch::randn({7, 6})).sum().backward();
    }
    return Trained{buffers_of(*net), grads_of(*net)};
  };
  const auto expected = run(false);
  const auto got = run(true);
  expect_equal(got.buffers, expected.buffers);
  expect_equal(got.grads, expected.grads);
}

TEST(CheckpointBatchNorm, WithoutNamedBuffersTheRecomputeCountsTwiceAndWithThemOnce) {
  auto count_after = [](bool name_buffers) {
    torch::manual_seed(25);
    torch::nn::BatchNorm1d bn(4);
    auto options = frugal::CheckpointOptions().params(bn->parameters());
    if (name_buffers) {
      options.buffers(frugal::training_buffers(*bn));
    }
    auto y = frugal::checkpoint([&bn](const torch::Tensor& x) { return bn(x); }, options,
                                torch::randn({6, 4}, torch::requires_grad()));
    y.sum().backward();
    return bn->num_batches_tracked.item<std::int64_t>();
  };
  EXPECT_EQ(count_after(false), 2);  // a bare block: the recompute is a second forward
  EXPECT_EQ(count_after(true), 1);
}

TEST(CheckpointBatchNorm, OnlyModulesInTrainingModeNameTheirBuffers) {
  auto net = dense_net();
  EXPECT_EQ(frugal::training_buffers(*net).size(), 6u);  // two layers x mean, var, counter
  net[1]->eval();
  EXPECT_EQ(frugal::training_buffers(*net).size(), 3u);
  net->eval();
  EXPECT_TRUE(frugal::training_buffers(*net).empty());
}

}  // namespace batch_norm
}  // namespace
