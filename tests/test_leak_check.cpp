// LeakCheck: the baseline after the warm-up, growth above the tolerance named; and the
// check in a frugal::Loop, which catches losses kept across iterations.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "frugal/loop/loop.h"
#include "frugal/memory/leak_check.h"

namespace {
namespace leak_check {  // helper names of its own in the unity build

TEST(LeakCheck, TakesTheBaselineAfterTheWarmupAndNamesTheGrowth) {
  frugal::LeakCheck check(frugal::LeakGuardOptions().warmup(2).tolerance(100));
  check.observe(5000, 1);  // warm-up: optimizer state appears
  check.observe(9000, 2);
  EXPECT_EQ(check.baseline(), -1);
  check.observe(8000, 3);
  EXPECT_EQ(check.baseline(), 8000);
  check.observe(8100, 4);  // within the tolerance
  check.observe(7000, 5);  // below the baseline is no growth
  EXPECT_EQ(check.growth(), 100);
  try {
    check.observe(8101 + 4096, 6);
    FAIL() << "a growth of 4197 bytes over a tolerance of 100 accepted";
  } catch (const frugal::LeakError& e) {
    EXPECT_EQ(e.growth(), 4197);
    EXPECT_NE(std::string(e.what()).find("after step 6"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("4197 bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(check.growth(), 4197);
}

TEST(LeakCheck, RecordsWithoutThrowingWhenAskedAndRefusesBadOptions) {
  frugal::LeakCheck check(frugal::LeakGuardOptions().warmup(0).throw_on_leak(false));
  check.observe(10, 1);
  check.observe(50, 2);
  EXPECT_EQ(check.growth(), 40);
  EXPECT_THROW(frugal::LeakCheck(frugal::LeakGuardOptions().warmup(-1)), std::exception);
  EXPECT_THROW(frugal::LeakCheck(frugal::LeakGuardOptions().tolerance(-5)), std::exception);
}

// Iterations of a two-model loop; `keep` keeps every loss tensor (the graph with it).
int iterations_until_leak(bool keep, int iterations) {
  torch::manual_seed(8);
  torch::nn::Linear a(16, 16), b(16, 1);
  torch::optim::Adam a_opt(a->parameters(), 1e-3), b_opt(b->parameters(), 1e-3);
  frugal::Loop loop(frugal::LoopOptions().leak_guard(frugal::LeakGuardOptions()));
  auto& ma = loop.prepare(a, a_opt, "a");
  auto& mb = loop.prepare(b, b_opt, "b");
  std::vector<torch::Tensor> kept;
  const auto x = torch::randn({32, 16});
  for (int i = 1; i <= iterations; ++i) {
    auto h = a->forward(x);
    auto a_loss = h.pow(2).mean();
    loop.backward(a_loss, ma, /*retain_graph=*/keep);
    loop.step(ma);
    auto b_loss = b->forward(h.detach()).pow(2).mean();
    if (keep) {
      kept.push_back(a_loss);
    }
    loop.backward(b_loss, mb);
    loop.step(mb);
    try {
      loop.end();
    } catch (const frugal::LeakError& e) {
      EXPECT_GT(e.growth(), 0);
      return i;
    }
  }
  return 0;
}

TEST(LeakCheck, ALoopKeepingItsLossesIsCaughtAndAFlatOneIsNot) {
  EXPECT_EQ(iterations_until_leak(/*keep=*/false, 10), 0);
  EXPECT_EQ(iterations_until_leak(/*keep=*/true, 10), 4);  // warm-up 2, baseline 3, caught at 4
}

}  // namespace leak_check
}  // namespace
