// Saving and resuming a frugal::Loop: two models, two optimizers and a loss scaler in one
// file; the resumed loop goes on bit for bit; another loop's file is refused by name.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include "frugal/loop/loop.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/state/training_state.h"
#include "helpers.h"
#include "state/state_file.h"

namespace {
namespace loop_state {  // helper names of its own in the unity build

namespace fs = std::filesystem;

// A teacher-student pair, each with its own Adam, under one scaler.
struct Pair {
  torch::nn::Sequential a, b;
  std::unique_ptr<torch::optim::Adam> a_opt, b_opt;
  std::shared_ptr<frugal::GradScaler> scaler;
  std::unique_ptr<frugal::Loop> loop;
  frugal::LoopModel *ma = nullptr, *mb = nullptr;

  explicit Pair(std::uint64_t seed, bool swap_names = false) {
    torch::manual_seed(seed);
    a = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8),
                              torch::nn::Linear(8, 1));
    b = torch::nn::Sequential(torch::nn::Linear(4, 1));
    a_opt = std::make_unique<torch::optim::Adam>(a->parameters(), 1e-2);
    b_opt = std::make_unique<torch::optim::Adam>(b->parameters(), 1e-2);
    scaler = std::make_shared<frugal::GradScaler>(frugal::GradScalerOptions().growth_interval(2));
    loop = std::make_unique<frugal::Loop>(frugal::LoopOptions().scaler(scaler));
    ma = &loop->prepare(a, *a_opt, swap_names ? "b" : "a");
    mb = &loop->prepare(b, *b_opt, swap_names ? "a" : "b");
  }
  // One iteration: `a` learns a target, `b` learns `a`'s output.
  std::pair<double, double> iterate() {
    const auto x = torch::randn({8, 4});
    auto out = a->forward(x);
    loop->backward((out - x.sum(1, true)).pow(2).mean(), *ma);
    loop->step(*ma);
    loop->backward((b->forward(x) - out.detach()).pow(2).mean(), *mb);
    loop->step(*mb);
    const auto r = loop->end();
    return {r.models[0].loss, r.models[1].loss};
  }
};

fs::path temp_file(const std::string& name) {
  return fs::temp_directory_path() / ("frugal-loop-" + std::to_string(::getpid()) + "-" + name);
}

TEST(LoopState, AResumedLoopGoesOnBitForBit) {
  const auto path = temp_file("resume.frugal");
  Pair straight(61);
  std::vector<std::pair<double, double>> expected;
  for (int i = 0; i < 10; ++i) {
    expected.push_back(straight.iterate());
  }
  Pair first(61);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(first.iterate(), expected[static_cast<std::size_t>(i)]);
  }
  frugal::save_training_state(*first.loop, path.string(), {{{"epoch", 3}}, {}, ""});
  Pair resumed(99);  // other weights and another generator state, all put back by the load
  const auto user = frugal::load_training_state(*resumed.loop, path.string());
  EXPECT_EQ(user.values.at("epoch"), 3);
  EXPECT_EQ(resumed.loop->iterations(), 5);
  EXPECT_EQ(resumed.ma->steps(), first.ma->steps());
  EXPECT_EQ(resumed.scaler->get_scale(), first.scaler->get_scale());
  EXPECT_EQ(resumed.scaler->growth_tracker(), first.scaler->growth_tracker());
  for (int i = 5; i < 10; ++i) {
    EXPECT_EQ(resumed.iterate(), expected[static_cast<std::size_t>(i)]) << "iteration " << i;
  }
  fs::remove(path);
}

TEST(LoopState, AnotherLoopOrPendingGradientsAreRefusedAndChangeNothing) {
  const auto path = temp_file("refused.frugal");
  Pair saved(62);
  saved.iterate();
  frugal::save_training_state(*saved.loop, path.string());
  Pair swapped(63, /*swap_names=*/true);
  const auto before = frugal::testing::clone_all(swapped.a->parameters());
  frugal::testing::expect_error_contains(
      [&] { frugal::load_training_state(*swapped.loop, path.string()); },
      "the list of models is [a, b] in the file, [b, a] here");
  const auto after = swapped.a->parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i]));
  }
  EXPECT_EQ(swapped.loop->iterations(), 0);
  Pair pending(64);
  pending.loop->backward(pending.b->forward(torch::randn({2, 4})).sum(), *pending.mb);
  frugal::testing::expect_error_contains(
      [&] { frugal::save_training_state(*pending.loop, path.string()); },
      "gradients waiting for its step");
  fs::remove(path);
}

TEST(LoopState, AFileLibTorchCannotReadIsRefusedByName) {
  const auto path = temp_file("garbage.frugal").string();
  frugal::detail::write_state_file(path, [](const frugal::detail::ByteWriter& write) {
    const std::string bytes = "a good checksum over bytes that are no archive";
    write(bytes.data(), bytes.size());
  });
  Pair pair(65);
  frugal::testing::expect_error_contains(
      [&] { frugal::load_training_state(*pair.loop, path); },
      "frugal: '" + path + "' cannot be read as a saved state: ");
  EXPECT_EQ(pair.loop->iterations(), 0);
  fs::remove(path);
}

}  // namespace loop_state
}  // namespace
