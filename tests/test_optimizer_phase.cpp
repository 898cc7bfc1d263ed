// The trainer's optimizer phase on its own: the window's division and the step, the count
// that follows, a non-finite window skipped, a failure before any write undone, a failure
// after some named and halting.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "frugal/error.h"
#include "step_parts.h"
#include "train/optimizer_phase.h"

namespace {

using frugal::testing::clone_all;
using frugal::testing::expect_all_close;
using frugal::testing::StepParts;

// Fails the optimizer phase before the optimizer steps, after writing the first parameter
// when `writes`.
struct FailBeforeStep : frugal::Policy {
  std::string name() const override { return "fail-before-step"; }
  void before_optimizer_step(frugal::StepContext& c) override {
    if (writes) {
      torch::NoGradGuard no_grad;
      c.module.parameters().front().add_(1.0);
    }
    throw std::runtime_error("injected failure before the step");
  }
  void on_optimizer_error(frugal::StepContext&, const std::exception& e) override {
    heard = e.what();
  }
  bool writes = false;
  std::string heard;
};

// Two batches of 6 in a window of 2, run as a step runs them; the window then waits for its
// optimizer phase.
struct OptimizerPhaseTest : ::testing::Test {
  OptimizerPhaseTest() : parts(frugal::TrainerOptions().micro_batch(3).accumulate(2)) {
    for (std::uint64_t seed : {31, 32}) {
      batches.push_back(StepParts::batch(6, seed));
      parts.run(batches.back());
    }
    parts.state.window.add(6);  // the first batch joined the window; the second ends it
    before = clone_all(parts.model->parameters());
  }
  void run_phase() {
    frugal::StepContext ctx(parts.port, none, report);
    frugal::detail::OptimizerPhase(parts.state, parts.policies).run(ctx, 12, /*ends_batch=*/true);
  }
  StepParts parts;
  std::vector<frugal::Batch> batches;
  frugal::Batch none;
  frugal::StepReport report;
  std::vector<torch::Tensor> before;
};

TEST_F(OptimizerPhaseTest, DividesTheWindowByItsCountStepsAndCountsTheStep) {
  const auto grads = parts.whole(batches).second;
  run_phase();
  std::vector<torch::Tensor> expected;
  for (std::size_t i = 0; i < before.size(); ++i) {
    expected.push_back(before[i] - 0.1 * grads[i]);  // SGD on the mean over both batches
  }
  expect_all_close(clone_all(parts.model->parameters()), expected);
  EXPECT_TRUE(report.stepped);
  EXPECT_FALSE(report.skipped);
  EXPECT_EQ(parts.state.counters.steps, 1);
  EXPECT_EQ(parts.state.counters.batches, 1);
  EXPECT_FALSE(parts.state.window.open());
  for (const auto& p : parts.model->parameters()) {
    EXPECT_FALSE(p.grad().defined());  // released (set_to_none)
  }
}

TEST_F(OptimizerPhaseTest, ANonFiniteWindowIsCountedAsASkippedStep) {
  parts.state.window.mark_non_finite();
  run_phase();
  expect_all_close(clone_all(parts.model->parameters()), before, 0, 0);
  EXPECT_TRUE(report.non_finite);
  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(parts.state.counters.steps, 1);
  EXPECT_EQ(parts.state.counters.skipped, 1);
}

TEST_F(OptimizerPhaseTest, AFailureBeforeAnyWriteLeavesParametersAndCountersAsTheyWere) {
  auto policy = std::make_shared<FailBeforeStep>();
  parts.policies.add(policy, parts.port);
  frugal::testing::expect_error_contains([&] { run_phase(); }, "injected failure");
  expect_all_close(clone_all(parts.model->parameters()), before, 0, 0);
  EXPECT_EQ(policy->heard, "injected failure before the step");
  EXPECT_EQ(parts.state.counters.steps, 0);
  EXPECT_FALSE(parts.state.window.open());  // the window's gradients were dropped
  EXPECT_TRUE(parts.state.halt.why().empty());
}

TEST_F(OptimizerPhaseTest, AFailureAfterAWriteNamesTheParameterAndHalts) {
  auto policy = std::make_shared<FailBeforeStep>();
  policy->writes = true;
  parts.policies.add(policy, parts.port);
  try {
    run_phase();
    ADD_FAILURE() << "no PartialStepError";
  } catch (const frugal::PartialStepError& e) {
    EXPECT_EQ(e.updated, std::vector<std::string>{"0.weight"});
  }
  EXPECT_NE(policy->heard.find("0.weight"), std::string::npos) << policy->heard;
  EXPECT_NE(parts.state.halt.why().find("step 1"), std::string::npos) << parts.state.halt.why();
  EXPECT_EQ(parts.state.counters.steps, 0);
  EXPECT_THROW(parts.state.halt.check(), std::exception);
}

}  // namespace
