// The planner stores units' matrices in 8 bits when nothing else fits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "frugal/compose/planner.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/optim/adam.h"

namespace {
namespace planner_int8_test {

constexpr std::int64_t kDim = 128, kHidden = 512;

struct UnitBlockImpl : torch::nn::Module {
  UnitBlockImpl()
      : up(register_module("up", torch::nn::Linear(kDim, kHidden))),
        down(register_module("down", torch::nn::Linear(kHidden, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(x))); }
  torch::nn::Linear up, down;
};
TORCH_MODULE(UnitBlock);

// Float32 blocks, reached through frugal::nn::call (or, `direct`, by their forward).
struct UnitNetImpl : torch::nn::Module {
  explicit UnitNetImpl(bool direct = false)
      : blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(kDim, 10))),
        direct(direct) {
    for (int i = 0; i < 4; ++i) {
      blocks->push_back(UnitBlock());
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < blocks->size(); ++i) {
      x = direct ? blocks->ptr<UnitBlockImpl>(i)->forward(x)
                 : frugal::nn::call(blocks->ptr<UnitBlockImpl>(i), x);
    }
    return head(x);
  }
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
  bool direct;
};
TORCH_MODULE(UnitNet);

struct Setup {
  UnitNet net{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<frugal::Trainer> trainer;
};

Setup setup(bool direct = false, bool frugal_adam = true) {
  frugal::CountingAllocator::install();  // before the model: its weights are counted too
  Setup s;
  torch::manual_seed(8);
  s.net = UnitNet(direct);
  const auto options = torch::optim::AdamOptions(1e-3);
  if (frugal_adam) {
    s.optimizer = std::make_unique<frugal::optim::Adam>(s.net->parameters(), options);
  } else {
    s.optimizer = std::make_unique<torch::optim::Adam>(s.net->parameters(), options);
  }
  s.trainer = std::make_unique<frugal::Trainer>(s.net, *s.optimizer,
                                                [](const torch::Tensor& o, const torch::Tensor& t) {
                                                  return torch::nn::functional::cross_entropy(o, t);
                                                });
  return s;
}

frugal::Batch batch() {
  torch::manual_seed(9);
  return {torch::randn({16, kDim}), torch::randint(0, 10, {16}, torch::kLong)};
}

frugal::MemoryPlannerOptions options() {
  return frugal::MemoryPlannerOptions().int8_weights(
      frugal::CheckpointSelect().types({"UnitBlock"}));
}

TEST(PlannerInt8Weights, ChosenOnlyWhenNothingElseFitsAndTheStepsKeepThePlannedBytes) {
  frugal::MemoryPlan survey;
  {
    auto s = setup();
    survey = frugal::MemoryPlanner(*s.trainer, options()).plan(std::int64_t{1} << 40, batch());
    // Room enough: the weights stay as they are.
    EXPECT_FALSE(survey.chosen.int8_weights);
    EXPECT_EQ(survey.int8_weights, nullptr);
    EXPECT_EQ(s.net->blocks->ptr<UnitBlockImpl>(0)->up->weight.numel(), kDim * kHidden);
  }
  std::cout << survey.table() << "\n";
  ASSERT_TRUE(survey.int8_cost.has_value());
  const auto& cost = *survey.int8_cost;
  // Each block's two matrices, as codes: a byte an element and 4 bytes a group of 128.
  EXPECT_EQ(cost.units, 4);
  EXPECT_EQ(cost.elements, 4 * 2 * kDim * kHidden);
  EXPECT_EQ(cost.bytes, 4 * cost.elements);
  EXPECT_EQ(cost.stored_bytes, cost.elements + 4 * cost.elements / 128);
  EXPECT_EQ(cost.unit_bytes, 4 * 2 * kDim * kHidden);
  std::int64_t with = std::int64_t{1} << 40, without = with;
  for (const auto& o : survey.options) {
    auto& best = o.int8_weights ? with : without;
    best = std::min(best, o.predicted_peak);
  }
  ASSERT_LT(with, without);
  const auto budget = static_cast<std::int64_t>((with + without) / 2 / (1 - survey.margin));

  auto s = setup();
  auto plan = frugal::MemoryPlanner(*s.trainer, options()).plan(budget, batch());
  std::cout << plan.table() << "\n";
  ASSERT_TRUE(plan.chosen.int8_weights) << plan.table();
  ASSERT_NE(plan.int8_weights, nullptr);
  EXPECT_NE(plan.table().find("+ 8-bit weights"), std::string::npos);
  EXPECT_EQ(plan.int8_weights->stored_elements(), cost.elements);
  EXPECT_EQ(plan.int8_weights->stored_bytes(), cost.stored_bytes);
  EXPECT_LE(plan.measured_peak, budget);
  // Three steps: under the budget, the loss going down, and between steps the weights are
  // the codes and the parameters that stayed (biases, the head), byte for byte.
  std::int64_t peak = 0;
  double first = 0, last = 0;
  frugal::Ledger ledger;
  const auto b = batch();
  for (int i = 0; i < 3; ++i) {
    const auto report = s.trainer->step(b);
    peak = std::max(peak, report.peak);
    (i == 0 ? first : last) = report.loss;
    ledger = report.ledger;
  }
  EXPECT_LE(peak, budget);
  EXPECT_LT(last, first);
  std::int64_t kept = 0;
  for (const auto& p : s.net->parameters()) {
    kept += static_cast<std::int64_t>(p.nbytes());  // a stored matrix: empty between steps
  }
  EXPECT_EQ(ledger.weights, kept + cost.stored_bytes);
  EXPECT_NEAR(static_cast<double>(plan.chosen.predicted_peak), static_cast<double>(peak),
              0.15 * static_cast<double>(peak));
}

TEST(PlannerInt8Weights, RefusedUpFrontOrBeforeAnythingChanges) {
  // LibTorch's optimizer cannot update codes; an optimizer with state is too late.
  {
    auto s = setup(false, /*frugal_adam=*/false);
    EXPECT_THROW(frugal::MemoryPlanner(*s.trainer, options()), c10::Error);
  }
  {
    auto s = setup();
    s.trainer->step(batch());
    EXPECT_THROW(frugal::MemoryPlanner(*s.trainer, options()), c10::Error);
  }
  {  // a rule that matches nothing, and units without a matrix large enough
    auto s = setup();
    EXPECT_THROW(frugal::MemoryPlanner(*s.trainer, frugal::MemoryPlannerOptions().int8_weights(
                                                       frugal::CheckpointSelect().types({"Nope"}))),
                 c10::Error);
    EXPECT_THROW(
        frugal::MemoryPlanner(
            *s.trainer, options().int8_options(
                            frugal::nn::Int8WeightsOptions().min_elements(kDim * kHidden + 1))),
        c10::Error);
  }
  // Blocks the forward calls directly: the first trial finds it, naming the block, with
  // every weight as it was and nothing stored.
  auto s = setup(/*direct=*/true);
  std::vector<torch::Tensor> before;
  for (const auto& p : s.net->parameters()) {
    before.push_back(p.detach().clone());
  }
  const auto buffers = s.net->buffers().size();
  frugal::MemoryPlanner planner(*s.trainer, options());
  try {
    planner.plan(std::int64_t{1} << 40, batch());
    ADD_FAILURE() << "a unit the forward does not reach through frugal::nn::call was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'blocks.0'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("frugal::nn::call"), std::string::npos) << e.what();
  }
  const auto after = s.net->parameters();
  ASSERT_EQ(after.size(), before.size());
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(after[i], before[i])) << i;
  }
  EXPECT_EQ(s.net->buffers().size(), buffers);
}

}  // namespace planner_int8_test
}  // namespace
