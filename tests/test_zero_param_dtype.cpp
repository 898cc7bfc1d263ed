// ZeRO-3 units gathered in bfloat16 (ZeroOptimizerOptions::param_dtype): each rank's range
// stays float32, the weights the optimizer updates; forward and backward see them rounded.
// The reference is a bf16 model trained through float32 copies (MasterCopy) by the same
// ranks, which does the same arithmetic with whole weights on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/error.h"
#include "zero_units_harness.h"

// In the harness's namespace: in a unity batch an anonymous one would share its names.
namespace frugal::testing::zero_units {

constexpr std::int64_t kBlockElements = kWidth * kWidth + kWidth;  // a block's elements

// Elements of each rank's share of `n` over `world` ranks, and of the padded flat buffer.
std::int64_t share_elements(std::int64_t n, std::int64_t world) { return (n + world - 1) / world; }
std::int64_t flat_elements(std::int64_t n, std::int64_t world) {
  return world * share_elements(n, world);
}

TEST(ZeroParamDtype, OneProcessTrainsAsBf16WeightsWithFloat32Copies) {
  const auto reference = train("bf16w", 0, Group::single());
  const auto units = train("bf16w", 33, Group::single());
  const auto in_backward = train("bf16w", 35, Group::single());
  expect_same_training(units, reference, 1e-5);
  expect_same_training(in_backward, reference, 1e-5);
  EXPECT_EQ(units.weights[0].scalar_type(), torch::kBFloat16);
  // The same units gathered in float32 under the same autocast.
  const auto float32 = train("bf16", 33, Group::single());
  const std::int64_t all = parameter_elements(reference);
  const std::int64_t root = all - kBlocks * kBlockElements;
  // Between steps the float32 range (one rank: all of it); the root unit and the blocks
  // whole in a block's forward cost 2 bytes an element instead of 4.
  EXPECT_EQ(units.weights_between, all * 4);
  EXPECT_EQ(units.weights_after_forward, all * 4 + root * 2);
  EXPECT_EQ(units.weights_in_forward, all * 4 + (root + 2 * kBlockElements) * 2);
  EXPECT_EQ(float32.weights_in_forward, all * 4 + (root + 2 * kBlockElements) * 4);
  // Stepped at the end, every gradient waits for the step: in bf16, the parameters' dtype.
  EXPECT_EQ(units.gradients_at_step, all * 2);
  EXPECT_EQ(float32.gradients_at_step, all * 4);
  EXPECT_EQ(in_backward.gradients_at_step, 0);
  EXPECT_LT(units.peak, float32.peak);
  EXPECT_LT(in_backward.peak, units.peak);
  std::cout << "one process: step peak " << units.peak << " B gathered in bf16 ("
            << in_backward.peak << " B stepped in backward), " << float32.peak << " B in float32\n";
}

TEST(ZeroParamDtype, NeedsStage3AndAFloatingDtype) {
  UnitNet model;
  expect_refused(model, ZeroOptimizerOptions().stage(2).param_dtype(torch::kBFloat16),
                 "param_dtype needs stage 3; got BFloat16 at stage 2");
  expect_refused(model, ZeroOptimizerOptions().stage(3).param_dtype(torch::kInt),
                 "param_dtype must be a floating-point dtype; got Int");
  // Refused before anything changed: the parameters are float32 and whole.
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
    EXPECT_GT(p.numel(), 0);
  }
}

// zero-param-dtype-train PREFIX: the reference, units gathered in bf16 stepped at the end and
// in backward, and units gathered in float32 under the same autocast.
const std::vector<std::pair<std::string, int>> kDtypeRuns{
    {"bf16w", 0}, {"bf16w", 33}, {"bf16w", 35}, {"bf16", 33}};

const RegisterChild register_dtype_runs = register_training("zero-param-dtype-train", kDtypeRuns);

void expect_ranks_train_as_master_copies(int world) {
  const auto ranks = frugal::testing::launch_and_load("zero-param-dtype-train", world);
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(world)) << "a rank failed";
  const std::size_t weights = 2 * (kBlocks + 2);
  const std::size_t per_run = weights + 3;  // weights, losses, bytes, eval
  const std::int64_t root = (8 * kWidth + kWidth) + (kWidth * 4 + 4);
  const std::int64_t shard =
      (share_elements(root, world) + kBlocks * share_elements(kBlockElements, world)) * 4;
  for (int r = 0; r < world; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(world));
    const auto* reference = &ranks[r][0];
    Run want;
    want.weights.assign(reference, reference + weights);
    want.eval_loss = reference[weights + 2].item<double>();
    for (std::size_t k = 1; k < 3; ++k) {
      SCOPED_TRACE("ZeRO " + std::to_string(kDtypeRuns[k].second));
      const auto* at = &ranks[r][k * per_run];
      Run got;
      got.weights.assign(at, at + weights);
      got.eval_loss = at[weights + 2].item<double>();
      expect_same_training(got, want, 1e-5);
      EXPECT_TRUE(torch::allclose(at[weights], reference[weights], 1e-5, 1e-5)) << "losses";
      const auto b = at[weights + 1];
      // Between steps and at the update: the float32 range of each unit, as without
      // param_dtype; the root unit whole after the forward, and in a block's forward that
      // block and the next one's prefetch, in 2 bytes an element (this rank's share is
      // rounded into its place in the flat buffer and sent from there: no copy of it).
      EXPECT_EQ(b[2].item<std::int64_t>(), shard);
      EXPECT_EQ(b[1].item<std::int64_t>(), shard);
      EXPECT_EQ(b[0].item<std::int64_t>(), shard + flat_elements(root, world) * 2);
      EXPECT_EQ(
          b[6].item<std::int64_t>(),
          shard + (flat_elements(root, world) + 2 * flat_elements(kBlockElements, world)) * 2);
    }
    // The whole units in 2 bytes an element, and no autocast copy of their weights: a
    // lower step peak than the same units gathered in float32 under the same autocast.
    const auto units = ranks[r][per_run + weights + 1];
    const auto float32 = ranks[r][3 * per_run + weights + 1];
    EXPECT_LT(units[3].item<std::int64_t>(), float32[3].item<std::int64_t>()) << "step peak";
    std::cout << "rank " << r << " of " << world << ": step peak " << units[3].item<std::int64_t>()
              << " B gathered in bf16 ("
              << ranks[r][2 * per_run + weights + 1][3].item<std::int64_t>()
              << " B stepped in backward), " << float32[3].item<std::int64_t>()
              << " B in float32\n";
  }
}

TEST(ZeroParamDtype, TwoRanksTrainAsBf16WeightsWithFloat32Copies) {
  expect_ranks_train_as_master_copies(2);
}

TEST(ZeroParamDtype, ThreeRanksTrainAsBf16WeightsWithFloat32Copies) {
  expect_ranks_train_as_master_copies(3);
}

}  // namespace frugal::testing::zero_units
