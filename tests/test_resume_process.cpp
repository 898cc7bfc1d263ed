// Resuming in a new process: bit for bit after a save, after SIGINT, and after SIGKILL
// during saves.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "children.h"
#include "resume_setup.h"

namespace {

namespace fs = std::filesystem;
using frugal::testing::make_resume_setup;
using frugal::testing::run_child;

// fit-run CONFIGS DIR MAX_STEPS OUT [SIGNAL_AT]: fits each configuration ("all" or one
// name) to MAX_STEPS steps, saving in DIR/<config> every 7 steps and resuming from it ("-":
// no saving); writes the weights and the losses of this process's steps to OUT-<config>.pt.
// At step SIGNAL_AT it sends itself SIGINT and exits 130 after fit has saved.
int fit_run(const std::vector<std::string>& args) {
  torch::set_num_threads(1);
  const auto configs =
      args.at(0) == "all" ? frugal::testing::resume_configs() : std::vector<std::string>{args[0]};
  const std::int64_t signal_at = args.size() > 4 ? std::stoll(args[4]) : 0;
  int status = 0;
  for (const auto& config : configs) {
    auto s = make_resume_setup(config);
    std::vector<double> losses;
    auto options = frugal::FitOptions()
                       .epochs(1000)
                       .batch_size(32)
                       .seed(5)
                       .max_steps(std::stoll(args.at(2)))
                       .on_step([&](const frugal::StepReport& r, const frugal::FitPosition& p) {
                         losses.push_back(r.loss);
                         if (p.step == signal_at && !s->trainer->window_open()) {
                           ::kill(::getpid(), SIGINT);
                         }
                       })
                       .log([](const std::string&) {});
    if (args.at(1) != "-") {
      options.save_dir(args[1] + "/" + config).save_every(7).resume(true);
    }
    const auto result =
        frugal::fit(*s->trainer, frugal::TensorData(frugal::testing::resume_data()), options);
    status = result.signal != 0 ? 128 + result.signal : status;
    torch::save(std::vector<torch::Tensor>{frugal::testing::flat_state(*s->model),
                                           torch::tensor(losses, torch::kDouble)},
                args.at(3) + "-" + config + ".pt");
  }
  return status;
}
const frugal::testing::RegisterChild kFitRun("fit-run", fit_run);

std::vector<torch::Tensor> load_result(const std::string& path) {
  std::vector<torch::Tensor> out;
  torch::load(out, path);
  return out;
}

void expect_same_run(const std::string& straight, const std::vector<std::string>& parts) {
  const auto a = load_result(straight);
  std::vector<torch::Tensor> losses;
  torch::Tensor weights;
  for (const auto& part : parts) {
    const auto b = load_result(part);
    weights = b[0];
    losses.push_back(b[1]);
  }
  EXPECT_TRUE(torch::equal(weights, a[0]))
      << "weights differ by up to " << (weights - a[0]).abs().max().item<double>();
  const auto joined = torch::cat(losses);
  ASSERT_EQ(joined.numel(), a[1].numel());
  EXPECT_TRUE(torch::equal(joined, a[1]))
      << "losses differ by up to " << (joined - a[1]).abs().max().item<double>();
}

TEST(Resume, ANewProcessGoesOnBitForBitInEveryConfiguration) {
  const auto dir = frugal::testing::fresh_temp_dir("resume_configs");
  const auto out = dir.string();
  ASSERT_EQ(run_child("fit-run", {"all", "-", "40", out + "/straight"}), 0);
  ASSERT_EQ(run_child("fit-run", {"all", out, "20", out + "/first"}), 0);
  ASSERT_EQ(run_child("fit-run", {"all", out, "40", out + "/second"}), 0);
  for (const auto& config : frugal::testing::resume_configs()) {
    SCOPED_TRACE(config);
    expect_same_run(out + "/straight-" + config + ".pt",
                    {out + "/first-" + config + ".pt", out + "/second-" + config + ".pt"});
  }
  fs::remove_all(dir);
}

TEST(Resume, SigintSavesAndTheResumedRunEndsWithTheSameWeights) {
  const auto dir = frugal::testing::fresh_temp_dir("resume_sigint");
  const auto out = dir.string();
  ASSERT_EQ(run_child("fit-run", {"checkpoint", "-", "40", out + "/straight"}), 0);
  // Stopped at step 17, between the saves every 7 steps: the signal's save is the newest.
  ASSERT_EQ(run_child("fit-run", {"checkpoint", out, "40", out + "/first", "17"}), 128 + SIGINT);
  EXPECT_TRUE(fs::exists(dir / "checkpoint" / "step-000000000017.frugal"));
  ASSERT_EQ(run_child("fit-run", {"checkpoint", out, "40", out + "/second"}), 0);
  expect_same_run(out + "/straight-checkpoint.pt",
                  {out + "/first-checkpoint.pt", out + "/second-checkpoint.pt"});
  fs::remove_all(dir);
}

// save-loop DIR: resumes from DIR if it can, then steps a wider model and saves after every
// step (keeping 2), until killed; creates DIR/started after its first save.
int save_loop(const std::vector<std::string>& args) {
  torch::set_num_threads(1);
  auto s = make_resume_setup("plain", /*hidden=*/512);
  frugal::SaveDir saves(args.at(0), /*keep=*/2);
  saves.resume(*s->trainer);
  const auto data = frugal::testing::resume_data();
  for (std::int64_t i = 0;; ++i) {
    s->trainer->step(data.slice((i * 8) % 320, 8));
    saves.save(*s->trainer);
    if (i == 0) {
      std::ofstream(args[0] + "/started") << "1";
    }
  }
}
const frugal::testing::RegisterChild kSaveLoop("save-loop", save_loop);

TEST(Resume, SigkillDuringSavesAlwaysLeavesTheLastSaveLoadable) {
  const auto dir = frugal::testing::fresh_temp_dir("resume_sigkill");
  std::mt19937 random(2024);
  std::uniform_int_distribution<int> delay_ms(0, 40);
  int torn = 0;  // kills that left a temporary file: they hit a save midway
  std::int64_t last_step = 0;
  auto check = make_resume_setup("plain", /*hidden=*/512);
  for (int kill_index = 0; kill_index < 20; ++kill_index) {
    fs::remove(dir / "started");
    const pid_t pid = frugal::testing::spawn_child("save-loop", {dir.string()});
    ASSERT_GT(pid, 0);
    for (int waited = 0; !fs::exists(dir / "started") && waited < 30000; waited += 5) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(fs::exists(dir / "started")) << "the saving child did not start";
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(random)));
    ::kill(pid, SIGKILL);
    ASSERT_EQ(frugal::testing::wait_child(pid), 128 + SIGKILL);

    for (const auto& entry : fs::directory_iterator(dir)) {
      torn += entry.path().filename().string().find(".tmp-") != std::string::npos ? 1 : 0;
    }
    frugal::SaveDir saves(dir.string(), 2);
    const auto files = saves.files();
    ASSERT_FALSE(files.empty());
    for (const auto& file : files) {  // every file there loads, the newest included
      EXPECT_NO_THROW(frugal::load_training_state(*check->trainer, file)) << file;
    }
    frugal::load_training_state(*check->trainer, files.front());
    EXPECT_GT(check->trainer->steps(), last_step) << "the run did not go on from its last save";
    last_step = check->trainer->steps();
  }
  RecordProperty("kills_during_a_write", torn);
  std::cout << "kills that interrupted a write: " << torn << " of 20\n";
  EXPECT_GT(torn, 0) << "no kill landed inside a save; the test did not test crash safety";
  fs::remove_all(dir);
}

}  // namespace
