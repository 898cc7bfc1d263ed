// The halt after a partial update, and the engine's non-finite guard.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "engine/non_finite_guard.h"
#include "engine/step_halt.h"
#include "frugal/error.h"

namespace {

TEST(StepHalt, RefusesWhileHaltedSayingWhyAndWhatLiftsIt) {
  frugal::detail::StepHalt halt;
  EXPECT_NO_THROW(halt.check());
  halt.halt("the optimizer step of step 3 changed 2 parameter(s) before failing");
  try {
    halt.check();
    FAIL() << "a halted trainer went on";
  } catch (const frugal::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("changed 2 parameter(s)"), std::string::npos) << what;
    EXPECT_NE(what.find("accept_partial_update()"), std::string::npos) << what;
  }
  halt.lift();
  EXPECT_TRUE(halt.why().empty());
  EXPECT_NO_THROW(halt.check());
}

TEST(NonFiniteGuard, SkipsOnANonFiniteLossOrGradientOnlyWhenOn) {
  auto w = torch::ones({3}, torch::requires_grad());
  torch::optim::SGD sgd(std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.1));
  (w * 2).sum().backward();
  const frugal::detail::NonFiniteGuard loss_only(true, false), with_grads(true, true);
  EXPECT_FALSE(loss_only.skips(false, sgd));
  EXPECT_TRUE(loss_only.skips(true, sgd));
  EXPECT_FALSE(with_grads.skips(false, sgd));
  w.mutable_grad()[1] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(frugal::detail::gradients_finite(sgd));
  EXPECT_FALSE(loss_only.skips(false, sgd));  // gradients are not read
  EXPECT_TRUE(with_grads.skips(false, sgd));
  frugal::detail::NonFiniteGuard owned(true, true);
  owned.disable();  // a policy owns the decision
  EXPECT_FALSE(owned.skips(true, sgd));
}

}  // namespace
