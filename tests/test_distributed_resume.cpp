// Data-parallel runs saved and resumed in new processes: rank 0's file for plain data
// parallelism, one file a rank under ZeRO.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "children.h"
#include "dist_launch.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/ranks.h"
#include "frugal/distributed/zero.h"
#include "frugal/fit/fit.h"
#include "frugal/optim/adam.h"
#include "frugal/state/save_dir.h"
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

// same-weights A B: exit 0 when the weight files A and B (written by dp-fit) are equal bit for
// bit, else 1 (scripts/kill_resume_soak.py).
int same_weights(const std::vector<std::string>& args) {
  std::vector<torch::Tensor> a, b;
  torch::load(a, args.at(0));
  torch::load(b, args.at(1));
  bool same = a.size() == b.size();
  for (std::size_t i = 0; same && i < a.size(); ++i) {
    same = torch::equal(a[i], b[i]);
  }
  return same ? 0 : 1;
}
const frugal::testing::RegisterChild register_same("same-weights", same_weights);

// Whether rank `r`'s run ended with weights equal to the straight run's, bit for bit.
void expect_weights_equal(const std::string& out, const std::string& straight,
                          const std::string& resumed) {
  for (int r = 0; r < 2; ++r) {
    std::vector<torch::Tensor> a, b;
    torch::load(a, out + "-" + straight + "-" + std::to_string(r) + ".pt");
    torch::load(b, out + "-" + resumed + "-" + std::to_string(r) + ".pt");
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(torch::equal(a[i], b[i])) << "rank " << r << " parameter " << i;
    }
  }
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), {}};
}

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
  expect_weights_equal(out, "straight", "second");
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

// A crash between two ranks' saves leaves their newest steps apart, and a file can be
// damaged on one rank: the ranks resume together from the newest step both hold whole.
TEST(DataParallelResume, ZeroStageThreeRanksResumeFromTheNewestStepEveryRankHoldsWhole) {
  const auto dir = frugal::testing::fresh_temp_dir("frugal-dist-resume-agree");
  const auto saves = dir / "saves";
  const auto out = (dir / "w").string();
  ASSERT_EQ(frugal::testing::launch("dp-fit", 2, {"zero3", "-", "22", out + "-straight"}),
            (std::vector<int>{0, 0}));
  ASSERT_EQ(frugal::testing::launch("dp-fit", 2, {"zero3", saves.string(), "12", out + "-first"}),
            (std::vector<int>{0, 0}));
  const auto step = [&](int rank, int n) {
    char name[40];
    std::snprintf(name, sizeof(name), "step-%012d.frugal", n);
    return saves / ("rank-" + std::to_string(rank)) / name;
  };
  ASSERT_TRUE(fs::exists(step(0, 12)) && fs::exists(step(1, 10)) && fs::exists(step(1, 5)));
  fs::remove(step(1, 12));  // rank 1 died before its save of step 12
  {
    std::fstream damaged(step(0, 10), std::ios::in | std::ios::out | std::ios::binary);
    damaged.seekp(100);
    damaged.put('\x7f');  // rank 0's step 10 is damaged: step 5 is the newest both hold
  }
  ASSERT_EQ(frugal::testing::launch("dp-fit", 2, {"zero3", saves.string(), "22", out + "-second"}),
            (std::vector<int>{0, 0}));
  expect_weights_equal(out, "straight", "second");
}

// Launches two dp-fit ranks (MODE, SAVES, up to 22 steps) that must both fail, each saying
// `expected`; their standard errors go to ERR-<name>-<rank>.txt.
void expect_both_ranks_refuse(const std::string& mode, const fs::path& saves,
                              const std::string& err, const std::string& name,
                              const std::string& expected) {
  ASSERT_EQ(frugal::testing::launch("dp-fit", 2, {mode, saves.string(), "22", err + "-w"},
                                    err + "-" + name + "-"),
            (std::vector<int>{3, 3}));
  for (int r = 0; r < 2; ++r) {
    const auto text = read_text(err + "-" + name + "-" + std::to_string(r) + ".txt");
    EXPECT_NE(text.find(expected), std::string::npos) << text;
  }
}

// Saves no step of which every rank holds: refused on every rank, naming what each holds; and
// the saves of a sharded optimizer are not silently ignored by a run without one.
TEST(DataParallelResume, RanksWithNoCommonStepOrAnotherSaveLayoutAreRefusedByName) {
  const auto dir = frugal::testing::fresh_temp_dir("frugal-dist-resume-refused");
  const auto saves = dir / "saves";
  const auto out = (dir / "w").string();
  const auto err = (dir / "err").string();
  ASSERT_EQ(frugal::testing::launch("dp-fit", 2, {"zero3", saves.string(), "12", out + "-first"}),
            (std::vector<int>{0, 0}));
  expect_both_ranks_refuse("adam", saves, err, "layout", "holds the saves of a sharded optimizer");
  EXPECT_TRUE(frugal::SaveDir::files_in(saves.string()).empty())
      << "a refused run wrote saves beside the rank folders";
  // And the other way round: plain data parallelism's saves met by a run under ZeRO-3.
  const auto plain_saves = dir / "plain-saves";
  ASSERT_EQ(frugal::testing::launch("dp-fit", 2, {"adam", plain_saves.string(), "12", out + "-a"}),
            (std::vector<int>{0, 0}));
  expect_both_ranks_refuse("zero3", plain_saves, err, "sharded",
                           "holds the saves of an optimizer that is not sharded");
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(
        frugal::SaveDir::files_in((plain_saves / ("rank-" + std::to_string(r))).string()).empty());
  }
  fs::remove_all(saves / "rank-1");
  fs::create_directory(saves / "rank-1");
  expect_both_ranks_refuse("zero3", saves, err, "common",
                           "rank 0 holds steps 12, 10, 5; rank 1 holds no whole save");
}

}  // namespace
