#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::clone_all;
using frugal::testing::expect_all_close;
using frugal::testing::grads_of;
using frugal::testing::make_mlp;
namespace F = torch::nn::functional;

using frugal::testing::mse;

frugal::Batch regression_batch(std::int64_t n, std::uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 10}), torch::randn({n, 3})};
}

// The gradient the optimizer sees, captured just before it steps.
std::vector<torch::Tensor> captured_gradient(frugal::TrainerOptions options,
                                             const frugal::Batch& batch) {
  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse, options);
  std::vector<torch::Tensor> seen;
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep,
                   [&](frugal::StepContext& c) { seen = grads_of(c.module); });
  trainer.step(batch);
  return seen;
}

std::vector<torch::Tensor> full_batch_gradient(const frugal::Batch& batch) {
  auto model = make_mlp(10, 32, 3);
  mse(model->forward(batch.inputs), batch.targets).backward();
  return grads_of(*model);
}

TEST(Accumulation, MicroBatchGradientsEqualTheFullBatch) {
  const auto batch = regression_batch(64, 1);
  const auto expected = full_batch_gradient(batch);
  for (const auto& options :
       {frugal::TrainerOptions(), frugal::TrainerOptions().micro_batch(64),
        frugal::TrainerOptions().micro_batch(16), frugal::TrainerOptions().micro_batch(25),
        frugal::TrainerOptions().micro_batches(3), frugal::TrainerOptions().micro_batch(1000)}) {
    SCOPED_TRACE(::testing::Message() << "micro_batch " << options.micro_batch().value_or(0)
                                      << " micro_batches "
                                      << options.micro_batches().value_or(0));
    expect_all_close(captured_gradient(options, batch), expected);
  }
}

TEST(Accumulation, UnevenSplitRunsAsPlanned) {
  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(25));
  std::vector<std::int64_t> sizes;
  trainer.add_hook(frugal::Phase::BeforeForward, [&](frugal::StepContext& c) {
    sizes.push_back(c.micro.inputs.size(0));
  });
  const auto report = trainer.step(regression_batch(64, 2));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{25, 25, 14}));
  EXPECT_EQ(report.micro_batches, 3);
  EXPECT_EQ(report.micro_batch, 25);
  EXPECT_EQ(report.samples, 64);
}

TEST(Accumulation, WeightsAfterThreeStepsEqualFullBatchTraining) {
  std::vector<frugal::Batch> batches;
  for (std::uint64_t s = 0; s < 3; ++s) {
    batches.push_back(regression_batch(64, 10 + s));
  }
  auto reference = make_mlp(10, 32, 3);
  torch::optim::SGD ref_sgd(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (const auto& b : batches) {
    ref_sgd.zero_grad();
    mse(reference->forward(b.inputs), b.targets).backward();
    ref_sgd.step();
  }
  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(25));
  for (const auto& b : batches) {
    trainer.step(b);
  }
  expect_all_close(clone_all(model->parameters()), clone_all(reference->parameters()));
}

TEST(Accumulation, SumLossWithTokenCountMatchesTheMeanOverTokens) {
  torch::manual_seed(3);
  auto inputs = torch::randn({64, 10});
  auto targets = torch::randint(0, 3, {64}, torch::kLong);
  // A third of the targets are padding: they carry no tokens.
  targets.index_put_({torch::rand({64}) < 0.33}, -100);
  const frugal::Batch batch{inputs, targets};
  auto ce_sum = [](const torch::Tensor& out, const torch::Tensor& t) {
    return F::cross_entropy(out, t, F::CrossEntropyFuncOptions().ignore_index(-100).reduction(
                                        torch::kSum));
  };
  auto reference = make_mlp(10, 32, 3);
  F::cross_entropy(reference->forward(inputs), targets,
                   F::CrossEntropyFuncOptions().ignore_index(-100))
      .backward();
  const auto expected = grads_of(*reference);

  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  auto options = frugal::TrainerOptions()
                     .micro_batch(20)
                     .reduction(frugal::LossReduction::SumOverCount)
                     .count([](const frugal::Batch& b) {
                       return b.targets.ne(-100).sum().item<std::int64_t>();
                     });
  frugal::Trainer trainer(model, sgd, ce_sum, options);
  std::vector<torch::Tensor> seen;
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep,
                   [&](frugal::StepContext& c) { seen = grads_of(c.module); });
  const auto report = trainer.step(batch);
  expect_all_close(seen, expected);
  EXPECT_EQ(report.count, targets.ne(-100).sum().item<std::int64_t>());
}

TEST(Accumulation, WindowsOfThreeBatchesWithAPartialLastWindow) {
  const std::vector<std::int64_t> sizes = {20, 12, 30, 8, 16, 24, 10};
  std::vector<frugal::Batch> batches;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    batches.push_back(regression_batch(sizes[i], 100 + i));
  }
  // Reference: each window as one concatenated batch.
  auto reference = make_mlp(10, 32, 3);
  torch::optim::SGD ref_sgd(reference->parameters(), 0.1);
  for (std::size_t start = 0; start < batches.size(); start += 3) {
    std::vector<torch::Tensor> xs, ys;
    for (std::size_t i = start; i < std::min(start + 3, batches.size()); ++i) {
      xs.push_back(batches[i].inputs);
      ys.push_back(batches[i].targets);
    }
    ref_sgd.zero_grad();
    mse(reference->forward(torch::cat(xs)), torch::cat(ys)).backward();
    ref_sgd.step();
  }

  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse,
                          frugal::TrainerOptions().accumulate(3).micro_batch(7));
  std::vector<bool> stepped;
  for (const auto& b : batches) {
    stepped.push_back(trainer.step(b).stepped);
  }
  EXPECT_EQ(stepped, (std::vector<bool>{false, false, true, false, false, true, false}));
  EXPECT_TRUE(trainer.flush());
  EXPECT_FALSE(trainer.flush());
  EXPECT_EQ(trainer.steps(), 3);
  expect_all_close(clone_all(model->parameters()), clone_all(reference->parameters()));
}

TEST(Accumulation, ReportedLossIsTheBatchMean) {
  const auto batch = regression_batch(50, 4);
  auto reference = make_mlp(10, 32, 3);
  const double expected = mse(reference->forward(batch.inputs), batch.targets).item<double>();
  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(16));
  EXPECT_NEAR(trainer.step(batch).loss, expected, 1e-6);
}

TEST(Accumulation, PhaseTimesFollowOneAnotherWithinTheTotal) {
  // Hooks that sleep put lower bounds on the phases they run in.
  auto model = make_mlp(10, 32, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(16));
  const auto nap = [](int ms) {
    return [ms](frugal::StepContext&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    };
  };
  trainer.add_hook(frugal::Phase::BeforeForward, nap(2));
  trainer.add_hook(frugal::Phase::BeforeBackward, nap(3));
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep, nap(4));
  for (int step = 0; step < 2; ++step) {
    const auto report = trainer.step(regression_batch(48, 7));
    const auto& t = report.time;
    ASSERT_EQ(report.micro_batches, 3);
    EXPECT_GE(t.forward_ms, 3 * 2.0);
    EXPECT_GE(t.backward_ms, 3 * 3.0);
    EXPECT_GE(t.optimizer_ms, 4.0);
    EXPECT_GE(t.data_ms, 0.0);
    // The phases are consecutive stretches of the step: together no longer than it.
    EXPECT_LE(t.data_ms + t.forward_ms + t.backward_ms + t.optimizer_ms, t.total_ms + 1e-9);
  }
}

TEST(CudaAccumulation, MicroBatchGradientsEqualTheFullBatch) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  const auto batch = regression_batch(64, 1);
  const auto expected = full_batch_gradient(batch);
  auto model = make_mlp(10, 32, 3);
  model->to(torch::kCUDA);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse,
                          frugal::TrainerOptions().micro_batch(25).device(torch::kCUDA));
  std::vector<torch::Tensor> seen;
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext& c) {
    for (const auto& g : grads_of(c.module)) {
      seen.push_back(g.cpu());
    }
  });
  trainer.step(batch);
  expect_all_close(seen, expected, 1e-4, 1e-5);
}

}  // namespace
