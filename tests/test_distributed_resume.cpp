// Data-parallel runs saved and resumed in new processes: rank 0's file for plain data
// parallelism, one file a rank under ZeRO.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "children.h"
#include "dist_launch.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/ranks.h"
#include "frugal/distributed/zero.h"
#include "frugal/fit/fit.h"
#include "frugal/optim/adam.h"
#include "frugal/train/trainer.h"
#include "resume_setup.h"

namespace {

namespace fs = std::filesystem;

// dp-fit MODE DIR MAX_STEPS OUT: 2 ranks fit a small model on 640 samples (batch 64, Adam,
// or Adam under ZeRO-2 or ZeRO-3 with MODE "zero2" or "zero3"; "zero3-in-backward": frugal's
// Adam under ZeRO-3 stepping in backward) up to MAX_STEPS steps, saving in DIR
// every 5 steps and resuming from it ("-": no saving); each rank writes its weights to
// OUT-<rank>.pt.
int dp_fit(const std::vector<std::string>& args) {
  torch::set_num_threads(1);
  const auto env = frugal::distributed::LaunchEnv::from_environment();
  auto group = frugal::distributed::Group::join(
      env, frugal::distributed::GroupOptions().timeout(std::chrono::seconds(60)));
  torch::manual_seed(11);
  const auto x = torch::randn({640, 8});
  const auto y = torch::randint(0, 4, {640});
  torch::manual_seed(100 + env.rank);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 4));
  const bool in_backward = args.at(0) == "zero3-in-backward";
  auto adam =
      [in_backward](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    if (in_backward) {
      return std::make_unique<frugal::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    }
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  };
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  const bool zero = args.at(0).rfind("zero", 0) == 0;
  if (zero) {
    optimizer = std::make_unique<frugal::distributed::ZeroOptimizer>(
        model->parameters(), group, adam,
        frugal::distributed::ZeroOptimizerOptions()
            .stage(args[0] == "zero2" ? 2 : 3)
            .step_in_backward(in_backward));
  } else {
    optimizer = adam(model->parameters());
  }
  frugal::Trainer trainer(model, *optimizer, [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  });
  trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(group));
  const bool saving = args.at(1) != "-";
  frugal::fit(trainer, frugal::TensorData({x, y}),
              frugal::FitOptions()
                  .epochs(100)
                  .batch_size(64)
                  .seed(5)
                  .max_steps(std::stoll(args.at(2)))
                  .save_dir(saving ? args[1] : "")
                  .save_every(saving ? 5 : 0)
                  .resume(saving)
                  .handle_signals(false)
                  .ranks(std::make_shared<frugal::distributed::GroupRanks>(group))
                  .log([](const std::string&) {}));
  std::vector<torch::Tensor> weights;
  {
    std::unique_ptr<frugal::optim::GatheredParameters> whole;  // ZeRO-3's are sharded
    if (zero) {
      whole = std::make_unique<frugal::optim::GatheredParameters>(
          dynamic_cast<frugal::optim::ShardedOptimizer&>(*optimizer));
    }
    for (const auto& p : model->parameters()) {
      weights.push_back(p.detach().clone());
    }
  }
  torch::save(weights, args.at(3) + "-" + std::to_string(env.rank) + ".pt");
  return 0;
}
const frugal::testing::RegisterChild register_fit("dp-fit", dp_fit);

void expect_resumed_run_equals_straight_run(const std::string& mode) {
  const auto dir = frugal::testing::fresh_temp_dir("frugal-dist-resume-" + mode);
  const auto saves = (dir / "saves").string();
  const auto out = (dir / "w").string();
  for (const auto& status :
       {frugal::testing::launch("dp-fit", 2, {mode, "-", "22", out + "-straight"}),
        frugal::testing::launch("dp-fit", 2, {mode, saves, "12", out + "-first"}),
        frugal::testing::launch("dp-fit", 2, {mode, saves, "22", out + "-second"})}) {
    ASSERT_EQ(status, (std::vector<int>{0, 0}));
  }
  // ZeRO keeps one folder a rank (their optimizer states differ); plain data parallelism one.
  EXPECT_EQ(fs::exists(fs::path(saves) / "rank-1"), mode != "adam");
  for (int r = 0; r < 2; ++r) {
    std::vector<torch::Tensor> straight, resumed;
    torch::load(straight, out + "-straight-" + std::to_string(r) + ".pt");
    torch::load(resumed, out + "-second-" + std::to_string(r) + ".pt");
    ASSERT_EQ(straight.size(), resumed.size());
    for (std::size_t i = 0; i < straight.size(); ++i) {
      EXPECT_TRUE(torch::equal(straight[i], resumed[i])) << "rank " << r << " parameter " << i;
    }
  }
}

TEST(DataParallelResume, TwoRanksResumeBitForBitFromRankZerosSaves) {
  expect_resumed_run_equals_straight_run("adam");
}

TEST(DataParallelResume, ZeroStageTwoRanksResumeBitForBitFromTheirOwnSaves) {
  expect_resumed_run_equals_straight_run("zero2");
}

TEST(DataParallelResume, ZeroStageThreeRanksResumeBitForBitFromTheirOwnSaves) {
  expect_resumed_run_equals_straight_run("zero3");
}

TEST(DataParallelResume, ZeroStageThreeSteppedInBackwardRanksResumeBitForBit) {
  expect_resumed_run_equals_straight_run("zero3-in-backward");
}

}  // namespace
