#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "compose/choose_plan.h"
#include "frugal/compose/planner.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/sgd.h"
#include "residual_mlp.h"

namespace {

namespace F = torch::nn::functional;

struct Setup {
  torch::nn::Sequential net = nullptr;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<frugal::Trainer> trainer;
};

enum class Optimizer { TorchSgd, FrugalSgd, Adam8bit };

Setup setup(Optimizer kind = Optimizer::TorchSgd) {
  frugal::CountingAllocator::install();  // before the model: its weights are counted too
  Setup s;
  torch::manual_seed(4);
  s.net = models::make_residual_mlp(8, 128, 1024, 10);
  const auto options = torch::optim::SGDOptions(0.01).momentum(0.9);
  if (kind == Optimizer::FrugalSgd) {
    s.optimizer = std::make_unique<frugal::optim::SGD>(s.net->parameters(), options);
  } else if (kind == Optimizer::Adam8bit) {
    s.optimizer = std::make_unique<frugal::optim::Adam8bit>(s.net->parameters(),
                                                            torch::optim::AdamOptions(1e-3));
  } else {
    s.optimizer = std::make_unique<torch::optim::SGD>(s.net->parameters(), options);
  }
  s.trainer = std::make_unique<frugal::Trainer>(
      s.net, *s.optimizer,
      [](const torch::Tensor& o, const torch::Tensor& t) { return F::cross_entropy(o, t); });
  return s;
}

frugal::Batch sample() {
  torch::manual_seed(5);
  return {torch::randn({1024, 128}), torch::randint(0, 10, {1024}, torch::kLong)};
}

frugal::MemoryPlannerOptions planner_options() {
  return frugal::MemoryPlannerOptions().checkpoint(
      frugal::CheckpointSelect().types({"ResidualBlock"}));
}

// Plans for `budget`, then trains three real steps; returns the plan and the real peak.
std::pair<frugal::MemoryPlan, std::int64_t> plan_and_train(std::int64_t budget) {
  auto s = setup();
  frugal::MemoryPlanner planner(*s.trainer, planner_options());
  const auto batch = sample();
  auto plan = planner.plan(budget, batch);
  std::int64_t peak = 0;
  for (int i = 0; i < 3; ++i) {
    peak = std::max(peak, s.trainer->step(batch).peak);
  }
  std::cout << plan.table() << "real step peak: " << peak << " bytes\n\n";
  return {plan, peak};
}

TEST(Planner, TightMediumAndLooseBudgetsFitAndPredictWithinFifteenPercent) {
  // Survey the options with an unbounded budget, then derive the three budgets.
  frugal::MemoryPlan survey;
  {
    auto s = setup();
    frugal::MemoryPlanner planner(*s.trainer, planner_options());
    survey = planner.plan(std::int64_t{1} << 40, sample());
  }
  std::cout << survey.table() << "\n";
  std::int64_t plain = 0, smallest = survey.options.front().predicted_peak;
  for (const auto& o : survey.options) {
    if (o.micro_batches == 1 && !o.checkpoint) {
      plain = o.predicted_peak;
    }
    smallest = std::min(smallest, o.predicted_peak);
  }
  ASSERT_LT(smallest, plain);
  const double keep = 1 - survey.margin;
  const auto loose = static_cast<std::int64_t>(2.0 * plain);
  const auto medium = static_cast<std::int64_t>((plain + smallest) / 2 / keep);
  const auto tight = static_cast<std::int64_t>(smallest / keep * 1.02);

  for (const auto budget : {tight, medium, loose}) {
    SCOPED_TRACE(::testing::Message() << "budget " << budget);
    const auto [plan, real_peak] = plan_and_train(budget);
    EXPECT_LE(real_peak, budget);
    EXPECT_LE(plan.measured_peak, budget);
    EXPECT_NEAR(static_cast<double>(plan.chosen.predicted_peak), static_cast<double>(real_peak),
                0.15 * static_cast<double>(real_peak));
    if (budget == loose) {
      EXPECT_EQ(plan.chosen.micro_batches, 1);
      EXPECT_FALSE(plan.chosen.checkpoint);
      EXPECT_FALSE(plan.chosen.autocast);
    } else {
      EXPECT_TRUE(plan.chosen.micro_batches > 1 || plan.chosen.checkpoint);
    }
  }
}

// A small batch: activations are few; the gradients and the optimizer state dominate.
frugal::Batch small_batch() {
  return {torch::randn({32, 128}), torch::randint(0, 10, {32}, torch::kLong)};
}

// Surveys the plans under an unbounded budget, then plans again for a budget halfway
// between the best predicted peak with the option `uses` and the best without it, and
// trains three steps. Returns the plan, the budget and the steps' highest peak.
struct OptionRun {
  frugal::MemoryPlan survey;  ///< under the unbounded budget
  frugal::MemoryPlan plan;
  std::int64_t budget = 0;
  std::int64_t peak = 0;
  std::int64_t optimizer_bytes = 0;  ///< the ledger's after the steps
  bool stochastic_codes = false;     ///< how the chosen states' codes round
};
OptionRun plan_between(Optimizer kind, const frugal::MemoryPlannerOptions& options,
                       bool (*uses)(const frugal::PlanOption&)) {
  const auto batch = small_batch();
  frugal::MemoryPlan survey;
  {
    auto s = setup(kind);
    survey = frugal::MemoryPlanner(*s.trainer, options).plan(std::int64_t{1} << 40, batch);
  }
  std::cout << survey.table() << "\n";
  std::int64_t with = std::int64_t{1} << 40, without = with;
  for (const auto& o : survey.options) {
    auto& best = uses(o) ? with : without;
    best = std::min(best, o.predicted_peak);
  }
  EXPECT_LT(with, without);
  OptionRun run;
  run.survey = survey;
  run.budget = static_cast<std::int64_t>((with + without) / 2 / (1 - survey.margin));
  auto s = setup(kind);
  frugal::MemoryPlanner planner(*s.trainer, options);
  run.plan = planner.plan(run.budget, batch);
  for (int i = 0; i < 3; ++i) {
    const auto report = s.trainer->step(batch);
    run.peak = std::max(run.peak, report.peak);
    run.optimizer_bytes = report.ledger.optimizer;
  }
  const auto* quantized =
      dynamic_cast<frugal::optim::QuantizedStateOptimizer*>(&s.trainer->optimizer());
  run.stochastic_codes = quantized != nullptr && quantized->state_format().stochastic;
  return run;
}

TEST(Planner, ChoosesTheStepInBackwardWhenTheGradientsSetThePeak) {
  const auto options = frugal::MemoryPlannerOptions().step_in_backward(true);
  const auto run = plan_between(Optimizer::FrugalSgd, options,
                                [](const frugal::PlanOption& o) { return o.step_in_backward; });
  EXPECT_TRUE(run.plan.chosen.step_in_backward) << run.plan.table();
  EXPECT_LE(run.peak, run.budget);
  EXPECT_NEAR(static_cast<double>(run.plan.chosen.predicted_peak), static_cast<double>(run.peak),
              0.15 * static_cast<double>(run.peak));
  // LibTorch's SGD cannot step in backward: the planner refuses the option up front.
  auto plain = setup();
  EXPECT_THROW(frugal::MemoryPlanner(*plain.trainer, options), c10::Error);
}

TEST(Planner, ChoosesEightBitStatesOnlyWhenFloat32StatesDoNotFit) {
  // Adam's two float32 moments (8 bytes a parameter) set the peak.
  const auto options = frugal::MemoryPlannerOptions().quantized_states(true);
  const auto run = plan_between(Optimizer::Adam8bit, options,
                                [](const frugal::PlanOption& o) { return o.states.has_value(); });
  EXPECT_FALSE(run.survey.chosen.states);  // room enough: float32 states
  ASSERT_TRUE(run.plan.chosen.states) << run.plan.table();
  EXPECT_LE(run.peak, run.budget);
  // The state the plan counted is the state the steps made, byte for byte.
  EXPECT_EQ(run.optimizer_bytes, run.plan.cost_of(8)->bytes);
  EXPECT_FALSE(run.stochastic_codes);  // 8-bit codes round to the nearest
  // An optimizer without 8-bit states cannot offer them.
  auto plain = setup();
  EXPECT_THROW(frugal::MemoryPlanner(*plain.trainer, options), c10::Error);
}

TEST(Planner, ChoosesFactoredStatesOnlyWhenEightBitStatesDoNotFit) {
  // The residual MLP's matrices: a factored second moment takes 4 (rows + columns) bytes
  // each instead of a byte an element.
  const auto options = frugal::MemoryPlannerOptions().quantized_states(true).factored_states(true);
  const auto run = plan_between(Optimizer::Adam8bit, options, [](const frugal::PlanOption& o) {
    return o.states && o.states->factored;
  });
  EXPECT_FALSE(run.survey.chosen.states);  // room enough: float32 states
  EXPECT_LT(run.survey.cost_of(8, true)->bytes, run.survey.cost_of(8)->bytes);
  ASSERT_TRUE(run.plan.chosen.states && run.plan.chosen.states->factored) << run.plan.table();
  EXPECT_EQ(run.plan.chosen.states->bits, 8);
  EXPECT_NE(run.plan.table().find("factored 8-bit states"), std::string::npos);
  EXPECT_LE(run.peak, run.budget);
  // The state the plan counted is the state the steps made, byte for byte.
  EXPECT_EQ(run.optimizer_bytes, run.plan.cost_of(8, true)->bytes);
  // An optimizer without 8-bit states cannot offer them.
  auto plain = setup();
  EXPECT_THROW(
      frugal::MemoryPlanner(*plain.trainer, frugal::MemoryPlannerOptions().factored_states(true)),
      c10::Error);
}

TEST(Planner, ChoosesFourBitStatesOnlyWhenEightBitStatesDoNotFit) {
  // Half a byte an element a moment instead of one: 4-bit states fit where 8-bit ones do not.
  const auto options = frugal::MemoryPlannerOptions().quantized_states(true).four_bit_states(true);
  const auto run = plan_between(Optimizer::Adam8bit, options, [](const frugal::PlanOption& o) {
    return o.states && o.states->bits == 4;
  });
  EXPECT_FALSE(run.survey.chosen.states);  // room enough: float32 states
  EXPECT_LT(run.survey.cost_of(4)->bytes, run.survey.cost_of(8)->bytes);
  ASSERT_TRUE(run.plan.chosen.states && run.plan.chosen.states->bits == 4) << run.plan.table();
  EXPECT_FALSE(run.plan.chosen.states->factored);
  EXPECT_NE(run.plan.table().find("+ 4-bit states"), std::string::npos);
  EXPECT_LE(run.peak, run.budget);
  // The state the plan counted is the state the steps made, byte for byte.
  EXPECT_EQ(run.optimizer_bytes, run.plan.cost_of(4)->bytes);
  // The optimizer was made with 8-bit states; the planner's 4-bit ones round their codes
  // stochastically, as four_bit_states() does.
  EXPECT_TRUE(run.stochastic_codes);

  // With factored states too, they come after 4-bit ones, and are 4-bit themselves.
  const auto all =
      frugal::MemoryPlannerOptions().quantized_states(true).four_bit_states(true).factored_states(
          true);
  const auto factored = plan_between(Optimizer::Adam8bit, all, [](const frugal::PlanOption& o) {
    return o.states && o.states->factored;
  });
  ASSERT_TRUE(factored.plan.chosen.states && factored.plan.chosen.states->factored)
      << factored.plan.table();
  EXPECT_EQ(factored.plan.chosen.states->bits, 4);
  EXPECT_NE(factored.plan.table().find("factored 4-bit states"), std::string::npos);
  EXPECT_LT(factored.plan.cost_of(4, true)->bytes, factored.plan.cost_of(4)->bytes);
  EXPECT_EQ(factored.optimizer_bytes, factored.plan.cost_of(4, true)->bytes);
  EXPECT_LE(factored.peak, factored.budget);

  // An odd block cannot hold 4-bit codes: the planner says so up front.
  auto s = setup();
  frugal::optim::Adam8bit odd(s.net->parameters(), torch::optim::AdamOptions(1e-3),
                              frugal::optim::QuantizedStateOptions().block(255));
  frugal::Trainer trainer(s.net, odd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::cross_entropy(o, t);
  });
  EXPECT_THROW(frugal::MemoryPlanner(trainer, options), c10::Error);
}

TEST(Planner, FactoredStatesAloneStartFromTheOptimizersOwnFormat) {
  // Without quantized_states the first format is the optimizer's as made (8-bit here), and
  // a plan that needs no other leaves it so.
  auto s = setup(Optimizer::Adam8bit);
  auto& adam = dynamic_cast<frugal::optim::Adam8bit&>(*s.optimizer);
  const auto plan =
      frugal::MemoryPlanner(*s.trainer, frugal::MemoryPlannerOptions().factored_states(true))
          .plan(std::int64_t{1} << 40, small_batch());
  EXPECT_FALSE(plan.chosen.states) << plan.table();
  EXPECT_EQ(adam.state_format(), frugal::optim::StateFormat{8});
  EXPECT_EQ(plan.optimizer_bytes, adam.pending_state_bytes(adam.state_format()));
  EXPECT_GT(plan.optimizer_bytes, plan.cost_of(8, true)->bytes);
  // Once a state exists the format is fixed, and the planner refuses to choose it.
  s.trainer->step(small_batch());
  EXPECT_THROW(adam.set_state_format({8, /*factored=*/true}), c10::Error);
  EXPECT_THROW(
      frugal::MemoryPlanner(*s.trainer, frugal::MemoryPlannerOptions().factored_states(true)),
      c10::Error);
}

TEST(Planner, ChooseBlocksCheckpointsOnlySomeBlocksWhenThereIsRoomForTheRest) {
  frugal::MemoryPlan survey;
  {
    auto s = setup();
    survey =
        frugal::MemoryPlanner(*s.trainer, planner_options()).plan(std::int64_t{1} << 40, sample());
  }
  std::int64_t plain = 0, checkpointed = 0;
  for (const auto& o : survey.options) {
    if (o.micro_batches == 1 && !o.autocast && !o.step_in_backward) {
      (o.checkpoint ? checkpointed : plain) = o.predicted_peak;
    }
  }
  ASSERT_LT(checkpointed, plain);
  // Room for checkpoint-all and a share of the plain blocks' activations.
  const auto budget = static_cast<std::int64_t>(
      static_cast<double>(checkpointed + (plain - checkpointed) * 2 / 5) / (1 - survey.margin));
  // Micro-batches fit this budget too, and which of the two is faster is for the clock to say.
  // An unbounded time tolerance makes every plan that fits equally fast, so the fixed order
  // decides (one policy each, then fewest micro-batches): the whole batch, checkpointed.
  auto s = setup();
  frugal::MemoryPlanner planner(*s.trainer,
                                planner_options().choose_blocks(true).time_tolerance(1e9));
  const auto batch = sample();
  const auto plan = planner.plan(budget, batch);
  std::cout << plan.table() << "\n";
  ASSERT_TRUE(plan.chosen.checkpoint) << plan.table();
  EXPECT_EQ(plan.chosen.micro_batches, 1);
  ASSERT_TRUE(plan.block_choice.fits) << plan.table();
  EXPECT_EQ(plan.chosen.blocks, 8);
  EXPECT_GT(plan.chosen.checkpointed_blocks, 0);
  EXPECT_LT(plan.chosen.checkpointed_blocks, 8);
  EXPECT_NE(plan.table().find("Which blocks to checkpoint"), std::string::npos);
  EXPECT_NE(plan.chosen.describe().find("of 8 blocks"), std::string::npos);
  std::int64_t peak = 0;
  for (int i = 0; i < 3; ++i) {
    peak = std::max(peak, s.trainer->step(batch).peak);
  }
  EXPECT_LE(peak, budget);
  EXPECT_NEAR(static_cast<double>(plan.chosen.predicted_peak), static_cast<double>(peak),
              0.15 * static_cast<double>(peak));
}

TEST(Planner, ImpossibleBudgetSaysWhatWouldBeNeededAndChangesNothing) {
  auto s = setup(Optimizer::Adam8bit);
  s.trainer->set_micro_batch(256);
  frugal::MemoryPlanner planner(*s.trainer, planner_options());
  auto& states = dynamic_cast<frugal::optim::QuantizedStateOptimizer&>(*s.optimizer);
  const auto format = states.state_format();
  try {
    planner.plan(1 << 20, sample());
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no plan fits the budget of 1.00 MiB"), std::string::npos)
        << e.what();
  }
  // The trials tried other micro-batches and formats; the failed plan put the trainer back.
  EXPECT_EQ(s.trainer->micro_batch(), 256);
  EXPECT_EQ(s.trainer->steps(), 0);
  EXPECT_EQ(states.state_format().bits, format.bits);
  EXPECT_EQ(states.state_format().factored, format.factored);
  EXPECT_THROW(planner.plan(0, sample()), c10::Error);
}

}  // namespace

namespace {

// Three plans that all fit and take about the same time; measured times jitter by up to
// 8% either way, as on a loaded machine. The choice must not follow the jitter.
TEST(PlannerChoice, EquallyFastPlansAreChosenByAFixedOrderWhateverTheNoise) {
  auto option = [](std::int64_t micro_batches, bool checkpoint, double ms) {
    frugal::PlanOption o;
    o.micro_batches = micro_batches;
    o.micro_batch = 64 / micro_batches;
    o.checkpoint = checkpoint;
    o.predicted_ms = ms;
    o.fits = true;
    return o;
  };
  const std::vector<frugal::PlanOption> truth = {option(2, true, 95), option(1, false, 100),
                                                 option(4, false, 97)};
  torch::manual_seed(0);
  for (int trial = 0; trial < 200; ++trial) {
    auto noisy = truth;
    for (auto& o : noisy) {
      o.predicted_ms *= 1 + 0.08 * (2 * torch::rand({1}).item<double>() - 1);
    }
    const auto* chosen =
        frugal::detail::choose_plan(noisy, frugal::MemoryPlannerOptions().time_tolerance());
    ASSERT_NE(chosen, nullptr);
    EXPECT_EQ(chosen->micro_batches, 1) << "trial " << trial;  // the simplest
    EXPECT_FALSE(chosen->checkpoint);
  }
  // Equally fast plans of other states' formats: 8-bit before 4-bit before factored.
  auto states = [&](bool quantized, bool four_bit, bool factored) {
    auto o = option(1, false, 100);
    if (quantized) {
      o.states = frugal::optim::StateFormat{four_bit ? 4 : 8, factored};
    }
    return o;
  };
  const std::vector<frugal::PlanOption> formats = {
      states(true, true, true), states(true, false, true), states(true, true, false)};
  const auto* lowest = frugal::detail::choose_plan(formats, 0.25);
  EXPECT_TRUE(lowest->states->bits == 4 && !lowest->states->factored);
  // A plan clearly faster than the tolerance still wins.
  auto faster = truth;
  faster[0].predicted_ms = 50;
  EXPECT_TRUE(frugal::detail::choose_plan(faster, 0.25)->checkpoint);
}

}  // namespace
