// The engine's guard against NaN/inf without a GradScaler, micro-batches that count
// nothing, and the loss as AfterForward hooks see it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "frugal/frugal.h"
#include "helpers.h"

namespace {

namespace F = torch::nn::functional;
using frugal::testing::clone_all;
using frugal::testing::make_mlp;

using frugal::testing::mse;

TEST(NonFinite, ANanLossSkipsTheStepInFloat32AndSaysSo) {
  torch::manual_seed(0);
  auto model = make_mlp(4, 8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(2));
  trainer.step({torch::randn({4, 4}), torch::randn({4, 2})});
  const auto before = clone_all(model->parameters());
  auto y = torch::randn({4, 2});
  y[3][1] = std::numeric_limits<float>::quiet_NaN();
  const auto r = trainer.step({torch::randn({4, 4}), y});
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(r.non_finite);
  EXPECT_EQ(trainer.skipped_steps(), 1);
  EXPECT_EQ(r.skipped_total, 1);
  EXPECT_NE(r.to_json().find("\"non_finite\":true"), std::string::npos);
  const auto after = model->parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i]));
    EXPECT_FALSE(after[i].grad().defined());
  }
  // The next finite batch steps again.
  EXPECT_FALSE(trainer.step({torch::randn({4, 4}), torch::randn({4, 2})}).skipped);
}

TEST(NonFinite, AnInfiniteGradientWithAFiniteLossIsCaughtWhenGradientsAreChecked) {
  // sqrt at 0: the loss is finite, its gradient infinite.
  auto run = [](bool check) {
    torch::manual_seed(0);
    auto model = make_mlp(4, 8, 1);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    frugal::Trainer trainer(
        model, sgd,
        [](const torch::Tensor& out, const torch::Tensor&) { return (out * 0).abs().sqrt().sum(); },
        frugal::TrainerOptions().check_gradients(check));
    return trainer.step({torch::randn({4, 4}), torch::zeros({4, 1})});
  };
  EXPECT_TRUE(run(true).non_finite);
  EXPECT_FALSE(run(false).skipped);  // the loss alone said nothing
}

TEST(NonFinite, TheGradScalerStillDecidesWhenThereIsOne) {
  torch::manual_seed(0);
  auto model = make_mlp(4, 8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse);
  auto scaler = std::make_shared<frugal::GradScaler>(frugal::GradScalerOptions().init_scale(8));
  trainer.add_policy(std::make_shared<frugal::GradScalerPolicy>(scaler));
  auto y = torch::randn({4, 2});
  y[0][0] = std::numeric_limits<float>::infinity();
  const auto r = trainer.step({torch::randn({4, 4}), y});
  EXPECT_TRUE(r.skipped);
  EXPECT_FALSE(r.non_finite);  // the scaler's skip, which also backed off
  EXPECT_EQ(scaler->get_scale(), 4.0);
}

TEST(NonFinite, AMicroBatchWithNoTokensWeighsNothing) {
  // Per-position targets; -1 marks padding. The last 3 samples are all padding.
  const auto x = torch::randn({8, 5, 4});
  auto y = torch::randint(3, {8, 5});
  y.narrow(0, 5, 3).fill_(-1);
  auto loss = [](const torch::Tensor& out, const torch::Tensor& t) {
    return F::cross_entropy(out.flatten(0, 1), t.flatten(), F::CrossEntropyFuncOptions().ignore_index(-1));
  };
  auto tokens = [](const frugal::Batch& b) { return b.targets.ne(-1).sum().item<std::int64_t>(); };
  auto run = [&](std::int64_t micro) {
    torch::manual_seed(4);
    auto model = torch::nn::Linear(4, 3);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    frugal::Trainer trainer(model, sgd, loss, frugal::TrainerOptions().micro_batch(micro).count(tokens));
    const auto r = trainer.step({x, y});
    return std::make_pair(r, model->weight.clone());
  };
  const auto whole = run(8);
  const auto micro = run(3);  // the last micro-batch (samples 6, 7) counts no token
  EXPECT_TRUE(std::isfinite(micro.first.loss));
  EXPECT_FALSE(micro.first.skipped);
  EXPECT_NEAR(micro.first.loss, whole.first.loss, 1e-6);
  EXPECT_TRUE(torch::allclose(micro.second, whole.second, 1e-5, 1e-7));
  // Evaluation in chunks of 3 too: the last chunk counts nothing.
  torch::manual_seed(4);
  auto model = torch::nn::Linear(4, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, loss, frugal::TrainerOptions().count(tokens));
  const auto whole_eval = trainer.evaluate({x, y}, 8);
  const auto chunked = trainer.evaluate({x, y}, 3);
  EXPECT_TRUE(std::isfinite(chunked.loss));
  EXPECT_NEAR(chunked.loss, whole_eval.loss, 1e-6);
}

TEST(NonFinite, AfterForwardHooksSeeTheWeightedLoss) {
  torch::manual_seed(0);
  auto model = make_mlp(4, 8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(3));
  std::vector<double> seen;
  trainer.add_hook(frugal::Phase::AfterForward, [&](frugal::StepContext& c) {
    ASSERT_TRUE(c.loss.defined());
    seen.push_back(c.loss.item<double>());
  });
  const auto r = trainer.step({torch::randn({4, 4}), torch::randn({4, 2})});
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_NEAR(seen[0] + seen[1], r.loss, 1e-6);  // weights 3/4 and 1/4 of the mean
}

}  // namespace

namespace {

TEST(NonFinite, TheStepInBackwardDoesNotWriteANanUpdate) {
  torch::manual_seed(0);
  auto model = make_mlp(4, 8, 2);
  frugal::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(2));
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  trainer.step({torch::randn({4, 4}), torch::randn({4, 2})});
  const auto before = clone_all(model->parameters());
  auto y = torch::randn({4, 2});
  y[0][0] = std::numeric_limits<float>::quiet_NaN();  // in the first micro-batch
  const auto r = trainer.step({torch::randn({4, 4}), y});
  EXPECT_TRUE(r.non_finite);
  const auto after = model->parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i])) << "parameter " << i;
  }
  EXPECT_FALSE(trainer.step({torch::randn({4, 4}), torch::randn({4, 2})}).skipped);
}

}  // namespace
