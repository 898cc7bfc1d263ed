// ZeRO-3 units: each block's weights are whole only around its own forward and backward.
// One process here, and 2 and 3 ranks against one process (children of this binary).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/error.h"
#include "zero_units_harness.h"

// In the harness's namespace: in a unity batch an anonymous one would share its names.
namespace frugal::testing::zero_units {

TEST(ZeroUnits, EachBlockIsWholeOnlyAroundItsOwnCallsInOneProcess) {
  const auto plain = train("micro", 0, Group::single());
  const auto units = train("micro", 33, Group::single());
  expect_same_training(units, plain, 1e-5);
  EXPECT_EQ(plain.whole_in_forward, kBlocks);
  EXPECT_EQ(units.whole_in_forward, 1);  // the block being called, no other
  EXPECT_GE(units.whole_in_backward, 1);
  EXPECT_LE(units.whole_in_backward, 2);  // the block in backward and the one just done
  // After the forward the root unit (embed, head) and the shard: the blocks are released.
  const std::int64_t all = parameter_elements(plain) * 4;
  const std::int64_t block = (kWidth * kWidth + kWidth) * 4;
  EXPECT_EQ(units.weights_after_forward, all + (all - kBlocks * block));
  // Inside a block's forward: that block, and the next one's prefetched weights.
  EXPECT_EQ(units.weights_in_forward, all + (all - kBlocks * block) + 2 * block);
  // One rank keeps its gradients on the parameters until the optimizer's step, which
  // releases the root unit; with more ranks it goes before (the tests below).
  EXPECT_EQ(units.weights_at_step, all + (all - kBlocks * block));
  EXPECT_EQ(units.weights_between, all);  // the shard alone (one rank: all of it)
}

TEST(ZeroUnits, UnitsSteppedInBackwardTrainAsOneProcessAndKeepNoGradientToTheStep) {
  const auto plain = train("micro", 0, Group::single());
  const auto at_end = train("micro", 33, Group::single());
  const auto in_backward = train("micro", 35, Group::single());
  expect_same_training(in_backward, plain, 1e-5);
  // Stepped at the end, the gradients of every parameter wait for the step; stepped in
  // backward, each unit's go when its last one is in, and none is left at the step.
  const std::int64_t all = parameter_elements(plain) * 4;
  EXPECT_EQ(at_end.gradients_at_step, all);
  EXPECT_EQ(in_backward.gradients_at_step, 0);
  EXPECT_LT(in_backward.peak, at_end.peak);
  // Without micro-batches (whose earlier backwards accumulate every gradient): the most
  // gradients alive in backward, a few blocks' against nearly all of them.
  const auto whole_batch_at_end = train("adam", 33, Group::single());
  const auto whole_batch = train("adam", 35, Group::single());
  const std::int64_t block = (kWidth * kWidth + kWidth) * 4;
  EXPECT_LE(whole_batch.gradients_in_backward, 2 * block);
  EXPECT_GE(whole_batch_at_end.gradients_in_backward, all - 2 * block);
  std::cout << "one process: step peak " << in_backward.peak << " B stepped in backward, "
            << at_end.peak << " B at the end; gradients alive in backward "
            << whole_batch.gradients_in_backward << " B against "
            << whole_batch_at_end.gradients_in_backward << " B\n";
}

TEST(ZeroUnits, StepInBackwardNeedsStage3AndOneOfFrugalsOptimizers) {
  UnitNet model;
  const std::vector<std::shared_ptr<torch::nn::Module>> blocks = model->blocks->children();
  try {
    ZeroOptimizer zero(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> p) { return make_inner("adam", std::move(p)); },
        ZeroOptimizerOptions().stage(3).units(blocks).step_in_backward(true));
    FAIL() << "LibTorch's Adam accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs one of frugal's optimizers"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("torch::optim::Adam"), std::string::npos) << e.what();
  }
  try {
    ZeroOptimizer zero(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> p) { return make_inner("adam", std::move(p), true); },
        ZeroOptimizerOptions().stage(2).step_in_backward(true));
    FAIL() << "stage 2 accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs stage 3; got stage 2"), std::string::npos)
        << e.what();
  }
}

TEST(ZeroUnits, BadUnitsAreRefusedNamingThem) {
  UnitNet model;
  const std::vector<std::shared_ptr<torch::nn::Module>> blocks = model->blocks->children();
  expect_refused(model, ZeroOptimizerOptions().stage(2).units(blocks),
                 "ZeRO units need stage 3; got 8 units at stage 2");
  expect_refused(model, ZeroOptimizerOptions().stage(3).units({blocks[0], model->blocks.ptr()}),
                 "share a parameter; units must not overlap");
  torch::nn::Linear stranger(2, 2);
  expect_refused(model, ZeroOptimizerOptions().stage(3).units({stranger.ptr()}),
                 "holds none of the optimizer's parameters");
}

// zero-units-train PREFIX: every rank trains each mode with units, adam also at stages 2
// and 3 without units, and bf16 also without ZeRO: a 20-step bf16 run of this deep model
// differs from one process by more than bf16's rounding of another summation order
// (up to 4e-3), so units are held to the same ranks without ZeRO.
const std::vector<std::pair<std::string, int>> kRuns{
    {"adam", 33}, {"sgd", 33}, {"micro", 33}, {"bf16", 33}, {"adam", 2},
    {"adam", 3},  {"bf16", 0}, {"adam", 34},  {"adam", 35}, {"micro", 35}};
constexpr std::size_t kBf16Plain = 6;

const RegisterChild register_units = register_training("zero-units-train", kRuns);

void expect_ranks_train_as_one_process(int world) {
  const auto ranks = frugal::testing::launch_and_load("zero-units-train", world);
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(world)) << "a rank failed";
  const std::size_t per_run = 2 * (kBlocks + 2) + 3;  // weights, losses, bytes, eval
  // The one-process runs, trained once and compared with every rank.
  std::vector<Run> one_process;
  for (const auto& [mode, zero] : kRuns) {
    one_process.push_back(train(mode, 0, Group::single()));
  }
  for (int r = 0; r < world; ++r) {
    std::vector<torch::Tensor> bytes;
    for (std::size_t k = 0; k < kRuns.size(); ++k) {
      const auto& [mode, zero] = kRuns[k];
      SCOPED_TRACE(mode + " at ZeRO " + std::to_string(zero) + ", rank " + std::to_string(r));
      auto one = one_process[k];
      const auto* at = &ranks[r][k * per_run];
      if (mode == "bf16") {  // the same ranks without ZeRO
        const auto* plain = &ranks[r][kBf16Plain * per_run];
        one.weights.assign(plain, plain + one.weights.size());
        one.losses = std::vector<double>(
            plain[one.weights.size()].data_ptr<double>(),
            plain[one.weights.size()].data_ptr<double>() + plain[one.weights.size()].numel());
        one.eval_loss = plain[one.weights.size() + 2].item<double>();
      }
      Run got;
      got.weights.assign(at, at + one.weights.size());
      got.eval_loss = at[one.weights.size() + 2].item<double>();
      const double tolerance = 1e-5;
      expect_same_training(got, one, tolerance);
      if (mode != "micro") {
        EXPECT_TRUE(torch::allclose(at[one.weights.size()],
                                    torch::tensor(one.losses, torch::kDouble), tolerance,
                                    tolerance));
      }
      bytes.push_back(at[one.weights.size() + 1]);
      const auto b = bytes.back();
      const std::int64_t elements = parameter_elements(one);
      if (zero >= 3) {  // adding DataParallel gathers nothing (once it gathered the model)
        EXPECT_LT(b[8].item<std::int64_t>(), elements * 4 / world) << "bytes while it was added";
      }
      if (zero > 3) {
        EXPECT_EQ(b[4].item<std::int64_t>(), 1) << "blocks whole in a block's forward";
        EXPECT_LE(b[5].item<std::int64_t>(), 2) << "blocks whole in a block's backward";
        // Between steps and at the update: this rank's range of each unit (root, 8 blocks).
        const std::int64_t root = (8 * kWidth + kWidth) + (kWidth * 4 + 4);
        const std::int64_t block = kWidth * kWidth + kWidth;
        const std::int64_t shard =
            ((root + world - 1) / world + kBlocks * ((block + world - 1) / world)) * 4;
        EXPECT_EQ(b[1].item<std::int64_t>(), shard);
        EXPECT_EQ(b[2].item<std::int64_t>(), shard);
        EXPECT_LE(static_cast<double>(shard), (world == 2 ? 0.55 : 0.4) * elements * 4);
        // The root unit stays whole until the update: its flat buffer, N ranges, padded.
        const std::int64_t root_flat = world * ((root + world - 1) / world) * 4;
        EXPECT_EQ(b[0].item<std::int64_t>(), shard + root_flat);
        // Inside a block's forward: its flat buffer, and with prefetch the next block's too.
        const std::int64_t block_flat = world * ((block + world - 1) / world) * 4;
        EXPECT_EQ(b[6].item<std::int64_t>(), shard + root_flat + (zero != 34 ? 2 : 1) * block_flat);
      }
    }
    // After forward, autograd's saved views of the released blocks hold no bytes: the rest
    // is the activations, as at stage 3 of the whole model (one block would be 16 kB more).
    const std::int64_t rest = bytes[5][7].item<std::int64_t>();
    EXPECT_NEAR(bytes[0][7].item<std::int64_t>(), rest, 1024) << "with prefetch";
    EXPECT_NEAR(bytes[7][7].item<std::int64_t>(), rest, 1024) << "without prefetch";
    // Adam with units against stage 2 and against stage 3 of the whole model: lower peaks.
    const auto units_peak = bytes[0][3].item<std::int64_t>();
    EXPECT_LT(units_peak, bytes[4][3].item<std::int64_t>()) << "stage 2's peak, rank " << r;
    EXPECT_LT(units_peak, bytes[5][3].item<std::int64_t>()) << "stage 3's peak, rank " << r;
    EXPECT_LT(bytes[7][3].item<std::int64_t>(), bytes[4][3].item<std::int64_t>())
        << "stage 2's peak against units without prefetch, rank " << r;
    // Each unit stepped in backward as its gradients arrive, against the same units stepped
    // at the end: no rank holds its range of all the gradients at once.
    const auto& in_backward = bytes[8];
    EXPECT_LT(in_backward[3].item<std::int64_t>(), units_peak) << "step peak, rank " << r;
    EXPECT_LT(in_backward[10].item<std::int64_t>(), bytes[0][10].item<std::int64_t>())
        << "gradients when a block's input gradient was in, rank " << r;
    EXPECT_LT(in_backward[9].item<std::int64_t>(), bytes[0][9].item<std::int64_t>())
        << "gradients at the optimizer step, rank " << r;
    std::cout << "rank " << r << " of " << world << ": stepped in backward: peak "
              << in_backward[3].item<std::int64_t>() << " B, gradients in backward "
              << in_backward[10].item<std::int64_t>() << " B (" << bytes[0][10].item<std::int64_t>()
              << " B stepped at the end), at the step " << in_backward[9].item<std::int64_t>()
              << " B (" << bytes[0][9].item<std::int64_t>() << " B)\n";
    std::cout << "rank " << r << " of " << world << ": step peak " << units_peak
              << " B with units (" << bytes[7][3].item<std::int64_t>() << " B without prefetch), "
              << bytes[4][3].item<std::int64_t>() << " B at stage 2, "
              << bytes[5][3].item<std::int64_t>() << " B at stage 3 whole\n";
  }
}

TEST(ZeroUnits, TwoRanksTrainAsOneProcessWithOneBlockWholeAtATime) {
  expect_ranks_train_as_one_process(2);
}

TEST(ZeroUnits, ThreeRanksTrainAsOneProcessWithOneBlockWholeAtATime) {
  expect_ranks_train_as_one_process(3);
}

}  // namespace frugal::testing::zero_units
