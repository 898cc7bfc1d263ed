// The gradient window: counting, taking aside and putting back, the division, zeroing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/gradient_window.h"

namespace {

using frugal::detail::GradientWindow;

struct WindowModel {
  WindowModel()
      : a(torch::ones({3}, torch::requires_grad())),
        b(torch::ones({2}, torch::requires_grad())),
        sgd(std::vector<torch::Tensor>{a, b}, torch::optim::SGDOptions(0.1)) {}
  void backward(double factor) { ((a * factor).sum() + (b * 2 * factor).sum()).backward(); }
  torch::Tensor a, b;
  torch::optim::SGD sgd;
};

TEST(GradientWindow, CountsItsBatchesUntilTheOneThatCompletesIt) {
  WindowModel m;
  GradientWindow window(m.sgd, 3, true);
  EXPECT_FALSE(window.open());
  EXPECT_FALSE(window.completes_with_next());
  window.add(5);
  window.add(7);
  EXPECT_TRUE(window.open());
  EXPECT_EQ(window.batches(), 2);
  EXPECT_EQ(window.count(), 12);
  EXPECT_TRUE(window.completes_with_next());
  window.mark_non_finite();
  window.drop();
  EXPECT_FALSE(window.open());
  EXPECT_EQ(window.count(), 0);
  EXPECT_FALSE(window.non_finite());
}

TEST(GradientWindow, DividesByTheWindowsCountOnlyOverSeveralBatches) {
  WindowModel m;
  GradientWindow one(m.sgd, 1, true);
  EXPECT_EQ(one.scale(8), 1.0);
  GradientWindow four(m.sgd, 4, true);
  EXPECT_EQ(four.scale(8), 1.0 / 8);
  // A micro-batch's weight: its share alone in a window, share / total in one batch.
  EXPECT_EQ(four.weight(3.0, 8), 3.0);
  EXPECT_EQ(one.weight(3.0, 8), 3.0 / 8);
  m.backward(4.0);                                                         // gradients 4 and 8
  four.divide(8, [&](const torch::Tensor& p) { return p.is_same(m.b); });  // b scaled already
  EXPECT_TRUE(m.a.grad().equal(torch::full({3}, 0.5)));
  EXPECT_TRUE(m.b.grad().equal(torch::full({2}, 8.0)));
}

TEST(GradientWindow, TakenGradientsComeBackAddedOrInPlace) {
  WindowModel m;
  GradientWindow window(m.sgd, 2, true);
  m.backward(1.0);
  auto taken = window.take();
  EXPECT_FALSE(m.a.grad().defined());
  ASSERT_EQ(taken.size(), 2u);
  m.backward(3.0);
  window.put_back(std::move(taken), /*add=*/true);
  EXPECT_TRUE(m.a.grad().equal(torch::full({3}, 4.0)));
  EXPECT_TRUE(m.b.grad().equal(torch::full({2}, 8.0)));
  auto again = window.take();
  m.backward(10.0);
  window.put_back(std::move(again), /*add=*/false);  // the taken ones replace the new
  EXPECT_TRUE(m.a.grad().equal(torch::full({3}, 4.0)));
}

TEST(GradientWindow, ZeroReleasesOrZeroesInPlace) {
  WindowModel m;
  m.backward(1.0);
  GradientWindow(m.sgd, 1, /*set_to_none=*/true).zero();
  EXPECT_FALSE(m.a.grad().defined());
  m.backward(1.0);
  const auto storage = m.a.grad().data_ptr();
  GradientWindow(m.sgd, 1, /*set_to_none=*/false).zero();
  ASSERT_TRUE(m.a.grad().defined());
  EXPECT_EQ(m.a.grad().data_ptr(), storage);
  EXPECT_EQ(m.a.grad().abs().sum().item<float>(), 0.0f);
}

}  // namespace
