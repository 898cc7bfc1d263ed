// ZeRO-3 with each rank's ranges stored as 8-bit codes: one process, two ranks, and a saved
// state resumed.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <sstream>

#include "frugal/error.h"
#include "zero_units_harness.h"

// In the harness's namespace: in a unity batch an anonymous one would share its names.
namespace frugal::testing::zero_units {

// Bytes of `elements` as codes with a bfloat16 zero point and scale a group of 128.
std::int64_t coded_bytes(std::int64_t elements) { return elements + 4 * ((elements + 127) / 128); }

// One rank's ranges of the root unit (embed, head) and of each block, as codes.
std::int64_t coded_ranges(std::int64_t world) {
  const std::int64_t root = (8 * kWidth + kWidth) + (kWidth * 4 + 4);
  const std::int64_t block = kWidth * kWidth + kWidth;
  return coded_bytes((root + world - 1) / world) +
         kBlocks * coded_bytes((block + world - 1) / world);
}

// The largest difference between two runs' weights.
float largest_difference(const Run& a, const Run& b) {
  float most = 0;
  for (std::size_t i = 0; i < a.weights.size(); ++i) {
    most = std::max(most, (a.weights[i] - b.weights[i]).abs().max().item<float>());
  }
  return most;
}

// 8-bit ranges train as float32 ones do, within the rounding: the losses and the weights
// close, the evaluation as good, and between steps the codes' bytes alone.
void expect_trains_like_float32(const Run& coded, const Run& float32, std::int64_t world) {
  EXPECT_EQ(coded.weights_between, coded_ranges(world));
  EXPECT_LT(3 * coded.weights_between, float32.weights_between);
  ASSERT_EQ(coded.losses.size(), float32.losses.size());
  for (std::size_t s = 0; s < coded.losses.size(); ++s) {
    EXPECT_NEAR(coded.losses[s], float32.losses[s], 0.02 * float32.losses[s]) << "step " << s;
  }
  EXPECT_NEAR(coded.eval_loss, float32.eval_loss, 0.02 * float32.eval_loss);
  // Each weight within 10 code steps of the float32 run's, a step being at most the widest
  // parameter's range over 255 (the embedding's, about 2.7e-3; a block's is 1e-3).
  float widest = 0;
  for (const auto& w : float32.weights) {
    widest = std::max(widest, (w.max() - w.min()).item<float>() / 255);
  }
  EXPECT_LT(largest_difference(coded, float32), 10 * widest);
  EXPECT_GT(largest_difference(coded, float32), 0.0F);  // rounded: not the float32 weights
}

TEST(ZeroInt8Ranges, OneProcessTrainsLikeFloat32RangesInAQuarterOfTheBytes) {
  const auto float32 = train("adam", 33, Group::single());
  const auto coded = train("adam", 36, Group::single());
  const auto in_backward = train("adam", 37, Group::single());
  expect_trains_like_float32(coded, float32, 1);
  expect_trains_like_float32(in_backward, float32, 1);
  // Stepped in backward, each unit's gradients go as soon as its codes are written.
  EXPECT_LT(in_backward.gradients_at_step, coded.gradients_at_step);
  std::cout << "one process: ranges " << coded.weights_between << " B as codes against "
            << float32.weights_between << " B in float32; largest weight difference "
            << largest_difference(coded, float32) << "\n";
}

const RegisterChild register_int8 =
    register_training("zero-int8-train", {{"adam", 36}, {"adam", 37}});

TEST(ZeroInt8Ranges, TwoRanksHoldHalfTheCodesEachAndTrainAsOneProcess) {
  const auto ranks = frugal::testing::launch_and_load("zero-int8-train", 2);
  ASSERT_EQ(ranks.size(), 2U) << "a rank failed";
  const auto float32 = train("adam", 33, Group::single());
  const std::size_t per_run = 2 * (kBlocks + 2) + 3;  // weights, losses, bytes, eval
  for (std::size_t k = 0; k < 2; ++k) {
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("run " + std::to_string(k) + ", rank " + std::to_string(r));
      const auto* at = &ranks[r][k * per_run];
      zero_units::Run got;
      got.weights.assign(at, at + float32.weights.size());
      const auto losses = at[float32.weights.size()];
      got.losses.assign(losses.data_ptr<double>(), losses.data_ptr<double>() + losses.numel());
      got.weights_between = at[float32.weights.size() + 1][2].item<std::int64_t>();
      got.eval_loss = at[float32.weights.size() + 2].item<double>();
      expect_trains_like_float32(got, float32, 2);
      // Every rank decodes the same codes: the same weights, bit for bit.
      for (std::size_t i = 0; i < float32.weights.size(); ++i) {
        EXPECT_TRUE(torch::equal(at[i], ranks[0][k * per_run + i])) << "parameter " << i;
      }
    }
  }
}

// A ZeroOptimizer with 8-bit ranges over the harness's model, in one process.
struct CodedTraining {
  explicit CodedTraining(std::uint64_t seed) {
    torch::manual_seed(seed);
    model = UnitNet();
    zero = std::make_unique<ZeroOptimizer>(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> p) { return make_inner("adam", std::move(p), true); },
        ZeroOptimizerOptions().stage(3).units(model->blocks->children()).int8_ranges(true));
    trainer = std::make_unique<frugal::Trainer>(model, *zero, cross_entropy);
    trainer->add_policy(std::make_shared<frugal::distributed::DataParallel>(Group::single()));
  }
  void steps(int from, int to) {
    torch::manual_seed(3);
    const auto x = torch::randn({8, kGlobal, 8});
    const auto y = torch::randint(0, 4, {8, kGlobal});
    for (int s = from; s < to; ++s) {
      trainer->step({x[s], y[s]});
    }
  }
  std::vector<torch::Tensor> weights() {
    frugal::optim::GatheredParameters whole(*zero);
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) {
      out.push_back(p.detach().clone());
    }
    return out;
  }
  UnitNet model{nullptr};
  std::unique_ptr<ZeroOptimizer> zero;
  std::unique_ptr<frugal::Trainer> trainer;
};

TEST(ZeroInt8Ranges, ASavedStateResumesBitForBitAndAWrongOneIsRefused) {
  CodedTraining first(1);
  first.steps(0, 3);
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    first.zero->save(archive);
    archive.save_to(saved);
  }
  first.steps(3, 6);
  const auto want = first.weights();

  CodedTraining resumed(2);  // other weights: the saved codes replace them
  {
    torch::serialize::InputArchive archive;
    archive.load_from(saved);
    resumed.zero->load(archive);
  }
  resumed.steps(3, 6);
  const auto got = resumed.weights();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(torch::equal(got[i], want[i])) << "parameter " << i;
  }

  // Float32 ranges' state is refused by 8-bit ranges, naming what it holds.
  UnitNet model;
  ZeroOptimizer plain(
      model->parameters(), Group::single(),
      [](std::vector<torch::Tensor> p) { return make_inner("adam", std::move(p), true); },
      ZeroOptimizerOptions().stage(3).units(model->blocks->children()));
  std::stringstream float32;
  {
    torch::serialize::OutputArchive archive;
    plain.save(archive);
    archive.save_to(float32);
  }
  CodedTraining refused(1);
  const auto before = refused.weights();
  torch::serialize::InputArchive archive;
  archive.load_from(float32);
  EXPECT_THROW(refused.zero->load(archive), c10::Error);
  const auto after = refused.weights();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(after[i], before[i])) << "parameter " << i;
  }
}

TEST(ZeroInt8Ranges, NeedStage3AndOneOfFrugalsOptimizers) {
  UnitNet model;
  expect_refused(model, ZeroOptimizerOptions().stage(2).int8_ranges(true), "needs stage 3");
  // make_inner("sgd") without in_place: LibTorch's SGD cannot write codes.
  expect_refused(model, ZeroOptimizerOptions().stage(3).int8_ranges(true),
                 "int8_ranges (updated in their codes) needs one of frugal's optimizers");
  // Refused, the ranges' codes are not left registered: 8-bit ranges work afterwards.
  CodedTraining after(1);
  after.steps(0, 1);
}

}  // namespace frugal::testing::zero_units
