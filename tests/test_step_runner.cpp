// The trainer's step runner on its own: micro-batches that add up to the whole batch, a
// retry split anew, a failed attempt that leaves nothing, earlier gradients kept aside.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "step_parts.h"
#include "train/step_runner.h"

namespace {

using frugal::StepContext;
using frugal::TrainerOptions;
using frugal::testing::expect_all_close;
using frugal::testing::grads_of;
using frugal::testing::StepParts;

// Throws in the forward of micro-batch `at` of its first `failures` attempts; retries with
// micro-batches of `retry_size`.
struct FailThenHalve : frugal::Policy {
  std::string name() const override { return "fail-then-halve"; }
  frugal::Traits traits() const override { return frugal::Trait::Retries; }
  void before_forward(StepContext& c) override {
    if (c.micro_index == at && failures > 0) {
      --failures;
      throw std::runtime_error("injected out of memory");
    }
  }
  bool on_step_error(StepContext& c, const std::exception&) override {
    c.port.set_micro_batch(retry_size);
    return retries;
  }
  std::int64_t at = 1;
  int failures = 1;
  std::int64_t retry_size = 2;
  bool retries = true;
};

TEST(StepRunner, MicroBatchesAddUpToTheWholeBatchsGradientAndLoss) {
  StepParts p(TrainerOptions().micro_batch(4));
  const auto batch = StepParts::batch(14);  // 4 + 4 + 4 + 2
  const auto [loss, grads] = p.whole({batch});
  const auto report = p.run(batch);
  EXPECT_EQ(report.micro_batches, 4);
  EXPECT_EQ(report.micro_batch, 4);
  EXPECT_EQ(report.count, 14);
  EXPECT_NEAR(report.loss, loss, 1e-6);
  expect_all_close(grads_of(*p.model), grads);
}

TEST(StepRunner, ARetryRunsTheBatchAgainSplitAsThePolicyChose) {
  StepParts p(TrainerOptions().micro_batch(4));
  auto policy = std::make_shared<FailThenHalve>();
  p.policies.add(policy, p.port);
  const auto batch = StepParts::batch(12);
  const auto [loss, grads] = p.whole({batch});
  const auto report = p.run(batch);
  EXPECT_EQ(report.oom_retries, 1);
  EXPECT_EQ(report.micro_batches, 6);  // 12 in micro-batches of 2
  EXPECT_NEAR(report.loss, loss, 1e-6);
  // The failed attempt's first micro-batch left nothing: the gradient is the batch's once.
  expect_all_close(grads_of(*p.model), grads);
}

TEST(StepRunner, AFailureNoPolicyRetriesLeavesNoGradients) {
  StepParts p(TrainerOptions().micro_batch(4));
  auto policy = std::make_shared<FailThenHalve>();
  policy->retries = false;
  p.policies.add(policy, p.port);
  frugal::testing::expect_error_contains([&] { p.run(StepParts::batch(12)); },
                                         "injected out of memory");
  for (const auto& param : p.model->parameters()) {
    EXPECT_FALSE(param.grad().defined());
  }
  EXPECT_TRUE(p.state.metrics.empty());
}

TEST(StepRunner, AnIsolatedBatchKeepsTheWindowsEarlierGradientsAsTheyWere) {
  StepParts p(TrainerOptions().micro_batch(4).accumulate(3));
  const auto first = StepParts::batch(8, 21);
  p.run(first);
  p.state.window.add(8);
  const auto earlier = grads_of(*p.model);  // summed, undivided until the window ends
  auto policy = std::make_shared<FailThenHalve>();
  policy->retries = false;
  p.policies.add(policy, p.port);
  EXPECT_THROW(p.run(StepParts::batch(8, 22), /*isolate=*/true), std::runtime_error);
  expect_all_close(grads_of(*p.model), earlier);

  // A batch that succeeds is added to them: the two together are the sum of both.
  policy->failures = 0;
  const auto second = StepParts::batch(8, 22);
  p.run(second, /*isolate=*/true);
  const auto both = p.whole({first, second}).second;
  auto summed = grads_of(*p.model);
  for (auto& g : summed) {
    g /= 16;  // the window's division, which its end would do
  }
  expect_all_close(summed, both);
}

}  // namespace
