// Micro-batches over BatchNorm layers: the trainer warns once naming them, refuses, or goes
// on silently, as TrainerOptions::batch_statistics says.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compat.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {
namespace batch_statistics {  // helper names of its own in the unity build

namespace F = torch::nn::functional;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(51);
    features = register_module(
        "features", torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8)));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(features->forward(x))); }
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

const frugal::Batch kBatch{torch::randn({8, 4}), torch::randint(2, {8})};

std::vector<std::string> warnings_of(Net net, frugal::TrainerOptions options, int steps = 2) {
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, F::cross_entropy, std::move(options));
  frugal::compat::WarningCapture capture;
  for (int i = 0; i < steps; ++i) {
    trainer.step(kBatch);
  }
  return capture.messages;
}

TEST(BatchStatistics, MicroBatchesOverBatchNormWarnOnceNamingTheLayers) {
  const auto warnings = warnings_of(Net(), frugal::TrainerOptions().micro_batch(4));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("micro-batches of 4 samples"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("'features.1'"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("batch_statistics(Accept)"), std::string::npos) << warnings[0];
}

TEST(BatchStatistics, AcceptedOrUnsplitOrInEvalModeTheyAreSilent) {
  EXPECT_TRUE(warnings_of(Net(), frugal::TrainerOptions().micro_batch(4).batch_statistics(
                                     frugal::BatchStatistics::Accept))
                  .empty());
  EXPECT_TRUE(warnings_of(Net(), frugal::TrainerOptions()).empty());
  EXPECT_TRUE(warnings_of(Net(), frugal::TrainerOptions().micro_batch(8)).empty());
  Net frozen_statistics;
  frozen_statistics->features[1]->eval();  // running statistics only: per-sample exact
  EXPECT_TRUE(warnings_of(frozen_statistics, frugal::TrainerOptions().micro_batch(4)).empty());
}

TEST(BatchStatistics, RefusedTheStepFailsBeforeAnythingChanges) {
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(
      net, sgd, F::cross_entropy,
      frugal::TrainerOptions().micro_batch(4).batch_statistics(frugal::BatchStatistics::Refuse));
  const auto before = frugal::testing::clone_all(net->parameters());
  const auto buffers = frugal::testing::clone_all(net->buffers());
  frugal::testing::expect_error_contains([&] { trainer.step(kBatch); },
                                         "batch statistics of 1 layer(s): 'features.1'");
  EXPECT_EQ(trainer.steps(), 0);
  const auto after = net->parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i]));
  }
  const auto after_buffers = net->buffers();
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(torch::equal(buffers[i], after_buffers[i]));  // no forward ran
  }
}

}  // namespace batch_statistics
}  // namespace
