#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <random>

#include "frugal/compose/checkpoint_budget.h"
#include "frugal/memory/counting_allocator.h"
#include "helpers.h"
#include "mixed_chain.h"

namespace frugal::testing::checkpoint_budget {

namespace F = torch::nn::functional;

struct Chain {
  torch::nn::Sequential net;
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<Trainer> trainer;
  std::shared_ptr<CheckpointPolicy> policy;
};

// Dense, gate, dense, gate, ... then a head; every block chosen for checkpointing.
std::unique_ptr<Chain> make_chain() {
  CountingAllocator::install();  // before the model: its weights are counted too
  torch::manual_seed(3);
  auto c = std::make_unique<Chain>();
  c->net = models::make_mixed_chain(4, 256, 6, 10);
  c->sgd = std::make_unique<torch::optim::SGD>(c->net->parameters(), 0.01);
  c->trainer = std::make_unique<Trainer>(
      c->net, *c->sgd,
      [](const torch::Tensor& o, const torch::Tensor& t) { return F::cross_entropy(o, t); });
  c->policy = std::make_shared<CheckpointPolicy>(CheckpointSelect().types({"DenseBlock", "GateBlock"}));
  c->trainer->add_policy(c->policy);
  return c;
}

Batch sample() {
  torch::manual_seed(4);
  return {torch::randn({128, 256}), torch::randint(0, 10, {128}, torch::kLong)};
}

bool is_gate(const std::string& name, const torch::nn::Sequential& net) {
  // The registered child: the Sequential's slot holds the checkpoint wrapper.
  return net->named_children()[name]->name().find("GateBlock") != std::string::npos;
}

// Brute force over every choice: the least added forward time within `limit`, or -1.
double best_by_brute_force(const std::vector<BlockCost>& blocks, std::int64_t outside,
                           std::int64_t limit) {
  double best = -1;
  const std::size_t n = blocks.size();
  for (std::uint32_t mask = 0; mask < (1u << n); ++mask) {
    std::vector<bool> checkpointed(n);
    double cost = 0;
    for (std::size_t j = 0; j < n; ++j) {
      checkpointed[j] = (mask >> j) & 1u;
      cost += checkpointed[j] ? blocks[j].forward_ms : 0;
    }
    if (predicted_checkpoint_peak(blocks, outside, checkpointed) <= limit &&
        (best < 0 || cost < best)) {
      best = cost;
    }
  }
  return best;
}

}  // namespace frugal::testing::checkpoint_budget

namespace {

using namespace frugal::testing::checkpoint_budget;

TEST(CheckpointBudget, TheDynamicProgramFindsTheBruteForceOptimum) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::int64_t> bytes(0, 60);
  std::uniform_real_distribution<double> ms(0.1, 5.0);
  int fitted = 0, refused = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<frugal::BlockCost> blocks(9);
    for (std::size_t j = 0; j < blocks.size(); ++j) {
      auto& b = blocks[j];
      b.name = std::to_string(j);
      b.kept_bytes = bytes(rng);
      b.backward_base = 100 + bytes(rng);
      b.checkpointed_peak = b.kept_bytes + bytes(rng) / 2 + 1;
      b.plain_peak = b.kept_bytes + bytes(rng) / 3;
      b.forward_ms = ms(rng);
    }
    const std::int64_t outside = 120 + bytes(rng);
    const std::int64_t limit = 150 + 2 * bytes(rng) + bytes(rng);
    const double best = best_by_brute_force(blocks, outside, limit);
    // One bucket a byte: the program is exact.
    const auto chosen = frugal::choose_checkpoints(blocks, outside, limit, limit);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " limit " << limit);
    if (best < 0) {
      EXPECT_TRUE(chosen.empty());
      ++refused;
      continue;
    }
    ASSERT_EQ(chosen.size(), blocks.size());
    ++fitted;
    double cost = 0;
    for (std::size_t j = 0; j < blocks.size(); ++j) {
      cost += chosen[j] ? blocks[j].forward_ms : 0;
    }
    EXPECT_LE(frugal::predicted_checkpoint_peak(blocks, outside, chosen), limit);
    EXPECT_NEAR(cost, best, 1e-9);
    // Coarse buckets round kept bytes up: never over the limit, never better than exact.
    const auto coarse = frugal::choose_checkpoints(blocks, outside, limit, 8);
    if (!coarse.empty()) {
      double coarse_cost = 0;
      for (std::size_t j = 0; j < blocks.size(); ++j) {
        coarse_cost += coarse[j] ? blocks[j].forward_ms : 0;
      }
      EXPECT_LE(frugal::predicted_checkpoint_peak(blocks, outside, coarse), limit);
      EXPECT_GE(coarse_cost, best - 1e-9);
    }
  }
  EXPECT_GT(fitted, 20);  // the random budgets cover both outcomes
  EXPECT_GT(refused, 20);
}

TEST(CheckpointBudget, ABudgetAboveCheckpointAllKeepsComputeHeavyBlocksPlainAndPredictsThePeak) {
  auto c = make_chain();
  const auto batch = sample();
  // Every block plain, then every block checkpointed: the two ends of the choice.
  c->policy->set_enabled(false);
  (void)c->trainer->trial(batch);
  const auto plain_peak = c->trainer->trial(batch).peak;
  const auto survey = frugal::plan_checkpoints(*c->trainer, *c->policy, plain_peak * 2, batch);
  ASSERT_TRUE(survey.fits) << survey.table();
  EXPECT_TRUE(survey.chosen().empty()) << survey.table();  // room for everything: none
  EXPECT_LT(survey.all_checkpointed_peak, plain_peak);
  ASSERT_EQ(survey.blocks.size(), 8u);
  EXPECT_NEAR(static_cast<double>(survey.measured_peak), static_cast<double>(plain_peak),
              0.02 * static_cast<double>(plain_peak));

  const auto budget =
      static_cast<std::int64_t>(1.1 * static_cast<double>(survey.all_checkpointed_peak));
  const auto plan = frugal::plan_checkpoints(*c->trainer, *c->policy, budget, batch);
  std::cout << plan.table() << "\n";
  ASSERT_TRUE(plan.fits) << plan.table();
  EXPECT_LE(plan.predicted_peak, budget);
  EXPECT_LE(plan.measured_peak, budget);
  EXPECT_NEAR(static_cast<double>(plan.predicted_peak), static_cast<double>(plan.measured_peak),
              0.1 * static_cast<double>(plan.measured_peak));
  // The gates keep the most for the least compute: they are the ones checkpointed, and
  // some dense block runs plainly.
  std::int64_t gates_kept = 0, dense_kept = 0;
  for (const auto& b : plan.blocks) {
    (is_gate(b.name, c->net) ? gates_kept : dense_kept) += b.kept_bytes;
  }
  EXPECT_GT(gates_kept, 2 * dense_kept);
  const auto chosen = plan.chosen();
  EXPECT_FALSE(chosen.empty());
  EXPECT_LT(chosen.size(), plan.blocks.size());
  for (const auto& name : chosen) {
    EXPECT_TRUE(is_gate(name, c->net)) << name << " is checkpointed\n" << plan.table();
  }
  // The trainer now runs the choice.
  EXPECT_NEAR(static_cast<double>(c->trainer->trial(batch).peak),
              static_cast<double>(plan.measured_peak),
              0.01 * static_cast<double>(plan.measured_peak));
}

TEST(CheckpointBudget, ABudgetBelowCheckpointAllSaysWhyAndLeavesEveryBlockCheckpointed) {
  auto c = make_chain();
  const auto batch = sample();
  const auto all = frugal::plan_checkpoints(*c->trainer, *c->policy, std::int64_t{1} << 40, batch);
  const auto budget =
      static_cast<std::int64_t>(0.9 * static_cast<double>(all.all_checkpointed_peak));
  const auto plan = frugal::plan_checkpoints(*c->trainer, *c->policy, budget, batch);
  EXPECT_FALSE(plan.fits);
  EXPECT_NE(plan.why.find("no choice of checkpointed blocks fits"), std::string::npos) << plan.why;
  EXPECT_NE(plan.why.find("with every block checkpointed"), std::string::npos) << plan.why;
  EXPECT_NE(plan.table().find(plan.why), std::string::npos);
  EXPECT_EQ(plan.chosen().size(), plan.blocks.size());
  const auto peak = c->trainer->trial(batch).peak;
  EXPECT_NEAR(static_cast<double>(peak), static_cast<double>(plan.all_checkpointed_peak),
              0.02 * static_cast<double>(peak));
}

TEST(CheckpointBudget, BadInputNamesTheBadValue) {
  auto c = make_chain();
  const auto batch = sample();
  frugal::testing::expect_error_contains(
      [&] { frugal::plan_checkpoints(*c->trainer, *c->policy, 0, batch); }, "got 0");
  frugal::testing::expect_error_contains(
      [&] {
        frugal::plan_checkpoints(*c->trainer, *c->policy, 1 << 30, batch,
                                 frugal::CheckpointBudgetOptions().margin(1.5));
      },
      "got 1.5");
  frugal::testing::expect_error_contains([&] { c->policy->set_enabled("blocks.9", false); },
                                         "'blocks.9'");
  frugal::testing::expect_error_contains([&] { frugal::choose_checkpoints({}, 0, -5); }, "got -5");
}

}  // namespace
