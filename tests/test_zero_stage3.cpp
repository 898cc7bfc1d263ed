// ZeRO stage 3 in one process: the weights between steps, gathered on demand, in the ledger
// and in a saved state. Two and three ranks are tested in test_distributed.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/zero.h"
#include "frugal/error.h"
#include "frugal/memory/ledger.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::distributed::Group;
using frugal::distributed::ZeroOptimizer;
using frugal::distributed::ZeroOptimizerOptions;
using frugal::optim::GatheredParameters;

torch::nn::Sequential zero3_model(int seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 3));
}

std::unique_ptr<ZeroOptimizer> stage3_sgd(const torch::nn::Sequential& model) {
  return std::make_unique<ZeroOptimizer>(
      model->parameters(), Group::single(),
      [](std::vector<torch::Tensor> shard) {
        return std::make_unique<torch::optim::SGD>(shard,
                                                   torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      ZeroOptimizerOptions().stage(3));
}

std::vector<torch::Tensor> copies(const torch::nn::Sequential& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model->parameters()) {
    out.push_back(p.detach().clone());
  }
  return out;
}

std::int64_t weight_bytes(const torch::nn::Sequential& model) {
  std::int64_t bytes = 0;
  for (const auto& p : model->parameters()) {
    bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
  }
  return bytes;
}

frugal::Batch zero3_batch(int seed) {
  torch::manual_seed(seed);
  return {torch::randn({8, 6}), torch::randint(0, 3, {8})};
}

torch::Tensor zero3_loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

TEST(ZeroStageThree, WeightsAreEmptyBetweenStepsAndWholeInsideGatheredParameters) {
  auto model = zero3_model(1);
  const auto before = copies(model);
  const auto whole_bytes = weight_bytes(model);
  auto zero = stage3_sgd(model);
  EXPECT_TRUE(zero->traits().has(frugal::Trait::ShardsParameters));
  EXPECT_FALSE(zero->parameters_whole());
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.numel(), 0);
  }
  // Reading the model between steps fails loudly instead of reading stale weights.
  EXPECT_THROW(model->forward(torch::randn({2, 6})), c10::Error);
  {
    GatheredParameters whole(*zero);
    EXPECT_TRUE(zero->parameters_whole());
    const auto now = copies(model);
    ASSERT_EQ(now.size(), before.size());
    for (std::size_t i = 0; i < now.size(); ++i) {
      EXPECT_TRUE(torch::equal(now[i], before[i])) << "parameter " << i;
    }
    {
      GatheredParameters nested(*zero);  // already whole: gathers and releases nothing
    }
    EXPECT_TRUE(zero->parameters_whole());
  }
  EXPECT_FALSE(zero->parameters_whole());
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.numel(), 0);
  }
  // Whole weights in the forward (the flat buffer and the range), the range alone after.
  frugal::Trainer trainer(model, *zero, zero3_loss);
  trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(Group::single()));
  std::int64_t in_forward = 0;
  trainer.add_hook(frugal::Phase::AfterForward, [&](frugal::StepContext& c) {
    in_forward = frugal::measure_ledger(c.probe, c.module, &c.optimizer).weights;
  });
  const auto report = trainer.step(zero3_batch(2));
  EXPECT_EQ(in_forward, 2 * whole_bytes);
  EXPECT_EQ(report.ledger.weights, whole_bytes);
  EXPECT_FALSE(zero->parameters_whole());
}

TEST(ZeroStageThree, TrainsAndEvaluatesAsTheOptimizerItWraps) {
  auto plain_model = zero3_model(3);
  torch::optim::SGD plain_sgd(plain_model->parameters(),
                              torch::optim::SGDOptions(0.1).momentum(0.9));
  frugal::Trainer plain(plain_model, plain_sgd, zero3_loss);
  auto model = zero3_model(3);
  auto zero = stage3_sgd(model);
  frugal::Trainer sharded(model, *zero, zero3_loss, frugal::TrainerOptions().micro_batch(3));
  sharded.add_policy(std::make_shared<frugal::distributed::DataParallel>(Group::single()));
  for (int s = 0; s < 5; ++s) {
    const auto batch = zero3_batch(10 + s);
    EXPECT_NEAR(sharded.step(batch).loss, plain.step(batch).loss, 1e-6) << "step " << s;
  }
  const auto held_out = zero3_batch(99);
  const auto expected = plain.evaluate(held_out);
  const auto got = sharded.evaluate(held_out);  // gathers and releases by itself
  EXPECT_NEAR(got.loss, expected.loss, 1e-6);
  EXPECT_DOUBLE_EQ(got.accuracy, expected.accuracy);
  EXPECT_FALSE(zero->parameters_whole());
  GatheredParameters whole(*zero);
  const auto want = copies(plain_model);
  const auto have = copies(model);
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::allclose(have[i], want[i], 1e-6, 1e-6)) << "parameter " << i;
  }
}

TEST(ZeroStageThree, ASavedStateHoldsTheRangeOfTheWeights) {
  auto model = zero3_model(4);
  auto zero = stage3_sgd(model);
  frugal::Trainer trainer(model, *zero, zero3_loss);
  trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(Group::single()));
  trainer.step(zero3_batch(5));
  std::ostringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    zero->save(archive);
    archive.save_to(bytes);
  }
  std::vector<torch::Tensor> saved;
  {
    GatheredParameters whole(*zero);
    saved = copies(model);
  }
  auto other_model = zero3_model(40);  // other weights, the same shapes
  auto other = stage3_sgd(other_model);
  std::istringstream in(bytes.str());
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  other->load(archive);
  {
    GatheredParameters whole(*other);
    const auto loaded = copies(other_model);
    for (std::size_t i = 0; i < saved.size(); ++i) {
      EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << "parameter " << i;
    }
  }
  // Another optimizer over the shards is refused by name, before LibTorch's own load.
  auto adam_model = zero3_model(41);
  ZeroOptimizer adam_zero(
      adam_model->parameters(), Group::single(),
      [](std::vector<torch::Tensor> shard) {
        return std::make_unique<torch::optim::Adam>(shard, torch::optim::AdamOptions(1e-3));
      },
      ZeroOptimizerOptions().stage(3));
  std::istringstream again(bytes.str());
  torch::serialize::InputArchive sgd_archive;
  sgd_archive.load_from(again);
  frugal::testing::expect_error_contains(
      [&] { adam_zero.load(sgd_archive); },
      "the saved ZeRO state is of the optimizer torch::optim::SGD over each shard; this "
      "ZeroOptimizer's function makes torch::optim::Adam");
}

TEST(ZeroStageThree, AStageOtherThanOneTwoOrThreeIsRefusedNamingIt) {
  auto model = zero3_model(6);
  try {
    ZeroOptimizer zero(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> shard) {
          return std::make_unique<torch::optim::SGD>(shard, torch::optim::SGDOptions(0.1));
        },
        ZeroOptimizerOptions().stage(4));
    FAIL() << "stage 4 was accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ZeRO stage must be 1, 2 or 3, got 4"), std::string::npos)
        << e.what();
  }
}

}  // namespace
