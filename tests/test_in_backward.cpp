// The engine's optimizer step in backward, which StepInBackward and Loop::backward_step both
// run: one parameter updated as step() would, its gradient released, the update recorded.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/in_backward.h"
#include "frugal/optim/adam.h"
#include "helpers.h"

namespace {

TEST(InBackward, RefusesAnOptimizerThatCannotUpdateOneParameter) {
  torch::nn::Linear layer(3, 2);
  torch::optim::Adam adam(layer->parameters(), 0.1);
  frugal::testing::expect_error_contains(
      [&] { frugal::detail::in_place_optimizer(adam, "Loop::backward_step of 'net'"); },
      "frugal: Loop::backward_step of 'net' updates one parameter at a time and needs one of "
      "frugal's optimizers (frugal::optim::SGD, Adam or AdamW); its optimizer is "
      "torch::optim::Adam");
}

TEST(InBackward, UpdatesOneParameterAsStepWouldAndReleasesItsGradient) {
  torch::manual_seed(3);
  torch::nn::Linear a(3, 2), b(3, 2);
  b->weight.set_data(a->weight.detach().clone());
  b->bias.set_data(a->bias.detach().clone());
  frugal::optim::Adam in_a(a->parameters(), torch::optim::AdamOptions(0.1));
  frugal::optim::Adam in_b(b->parameters(), torch::optim::AdamOptions(0.1));
  const auto x = torch::randn({4, 3});
  a->forward(x).square().sum().backward();
  b->forward(x).square().sum().backward();
  b->bias.mutable_grad().reset();  // step() then updates the weight alone
  in_b.step();

  std::vector<torch::Tensor> updated;
  auto& optimizer = frugal::detail::in_place_optimizer(in_a, "the test");
  frugal::detail::step_in_backward(optimizer, a->weight, updated);
  EXPECT_TRUE(torch::equal(a->weight, b->weight));
  EXPECT_FALSE(a->weight.grad().defined());
  ASSERT_EQ(updated.size(), 1u);
  EXPECT_TRUE(updated[0].is_same(a->weight));
  EXPECT_TRUE(torch::equal(a->bias, b->bias));  // the other parameter waits for its own call
  EXPECT_TRUE(a->bias.grad().defined());
}

}  // namespace
