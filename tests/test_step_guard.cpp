// The optimizer-step guard on its own: which parameters a step changed, and the state of
// the others put back as it was (counters by value, other states from a shallow copy).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "compat.h"
#include "engine/step_guard.h"

namespace {

using frugal::detail::OptimizerStepGuard;

// Three parameters with Adam's state after one ordinary step.
struct Stepped {
  std::vector<torch::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  template <typename Optimizer, typename Options>
  static Stepped make(Options options) {
    torch::manual_seed(3);
    Stepped s;
    for (int i = 0; i < 3; ++i) {
      s.params.push_back(torch::randn({4, 5}).requires_grad_());
    }
    s.optimizer = std::make_unique<Optimizer>(s.params, options);
    for (auto& p : s.params) {
      p.mutable_grad() = torch::randn_like(p);
    }
    s.optimizer->step();
    return s;
  }

  template <typename State>
  State& state(std::size_t i) {
    return static_cast<State&>(
        *optimizer->state().at(frugal::compat::optimizer_state_key(params.at(i))));
  }
};

bool contains(const std::vector<torch::Tensor>& list, const torch::Tensor& t) {
  return std::any_of(list.begin(), list.end(), [&](const auto& x) { return x.is_same(t); });
}

TEST(OptimizerStepGuard, AdamCountersOfUnchangedParametersComeBack) {
  using State = torch::optim::AdamParamState;
  auto s = Stepped::make<torch::optim::Adam>(torch::optim::AdamOptions(1e-2));
  ASSERT_EQ(s.state<State>(0).step(), 1);
  const auto first_moment = s.state<State>(0).exp_avg().clone();
  OptimizerStepGuard guard(*s.optimizer);
  // A step that fails midway: every counter moved, the second parameter's moment was
  // written, the third's was replaced by a new tensor of the same values.
  for (std::size_t i = 0; i < 3; ++i) {
    s.state<State>(i).step(2);
  }
  torch::NoGradGuard no_grad;
  s.state<State>(1).exp_avg().mul_(0.9);
  s.state<State>(2).exp_avg(s.state<State>(2).exp_avg().clone());

  const auto changed = guard.changed();
  EXPECT_EQ(changed.size(), 2u);
  EXPECT_FALSE(contains(changed, s.params[0]));
  EXPECT_TRUE(contains(changed, s.params[1]));
  EXPECT_TRUE(contains(changed, s.params[2])) << "a replaced state tensor is a change";
  guard.restore_unchanged();
  EXPECT_EQ(s.state<State>(0).step(), 1) << "the unchanged parameter's counter came back";
  EXPECT_TRUE(torch::equal(s.state<State>(0).exp_avg(), first_moment));
  EXPECT_EQ(s.state<State>(1).step(), 2) << "a changed parameter keeps what the step wrote";
  EXPECT_EQ(s.state<State>(2).step(), 2);
}

TEST(OptimizerStepGuard, AWrittenParameterIsAChangeAndNewStateIsRemoved) {
  auto s = Stepped::make<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9));
  auto extra = torch::randn({2}).requires_grad_();
  s.optimizer->add_param_group(torch::optim::OptimizerParamGroup({extra}));
  OptimizerStepGuard guard(*s.optimizer);
  torch::NoGradGuard no_grad;
  s.params[0].add_(1.0);
  s.optimizer->state()[frugal::compat::optimizer_state_key(extra)] =
      std::make_unique<torch::optim::SGDParamState>();
  const auto changed = guard.changed();
  ASSERT_EQ(changed.size(), 1u);
  EXPECT_TRUE(changed[0].is_same(s.params[0]));
  guard.restore_unchanged();
  EXPECT_EQ(s.optimizer->state().count(frugal::compat::optimizer_state_key(extra)), 0u)
      << "state the failed step created is removed";
  EXPECT_EQ(s.optimizer->state().size(), 3u);
}

TEST(OptimizerStepGuard, StatesOfOtherTypesComeBackFromTheirCopy) {
  using State = torch::optim::RMSpropParamState;
  auto s = Stepped::make<torch::optim::RMSprop>(torch::optim::RMSpropOptions(1e-2));
  const auto step = s.state<State>(0).step();
  OptimizerStepGuard guard(*s.optimizer);
  s.state<State>(0).step(step + 5);
  EXPECT_TRUE(guard.changed().empty());
  guard.restore_unchanged();
  EXPECT_EQ(s.state<State>(0).step(), step);
}

}  // namespace
