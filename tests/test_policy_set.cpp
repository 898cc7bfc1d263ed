// The trainer's policy set on its own: the order of calls, the refused pairs, the first
// retry that wins, the optimizer-error calls, the gradient-ready calls and the evaluation
// scopes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "step_parts.h"
#include "train/policy_set.h"

namespace {

using frugal::Policy;
using frugal::StepContext;
using frugal::Trait;
using frugal::Traits;
using frugal::detail::PolicySet;

// Writes "<name>:<what>" into a shared log for each call it gets.
struct Recorder : Policy {
  Recorder(std::string name, std::vector<std::string>& log, Traits traits = {})
      : name_(std::move(name)), log_(log), traits_(traits) {}
  std::string name() const override { return name_; }
  Traits traits() const override { return traits_; }
  void on_add(frugal::PolicyPort&) override { note("add"); }
  void before_backward(StepContext&) override { note("before-backward"); }
  bool on_step_error(StepContext&, const std::exception&) override {
    note("error");
    return retries;
  }
  void on_optimizer_error(StepContext&, const std::exception&) override {
    note("optimizer-error");
    if (raises) {
      throw std::runtime_error(name_ + " raised");
    }
  }
  void on_grad_ready(StepContext&, const torch::Tensor&) override { note("ready"); }
  void on_evaluate_begin(frugal::PolicyPort&) override {
    note("eval-begin");
    if (refuses_evaluation) {
      throw std::runtime_error(name_ + " refuses to evaluate");
    }
  }
  void on_evaluate_end(frugal::PolicyPort&) override { note("eval-end"); }
  void note(const char* what) { log_.push_back(name_ + ":" + what); }

  std::string name_;
  std::vector<std::string>& log_;
  Traits traits_;
  bool retries = false;
  bool raises = false;
  bool refuses_evaluation = false;
};

struct PolicySetTest : ::testing::Test {
  std::shared_ptr<Recorder> add(const std::string& name, Traits traits = {}) {
    auto policy = std::make_shared<Recorder>(name, log, traits);
    set.add(policy, parts.port);
    return policy;
  }
  frugal::testing::StepParts parts;
  PolicySet set{Traits{}};
  std::vector<std::string> log;
  frugal::StepReport report;
  frugal::Batch batch;
  StepContext ctx{parts.port, batch, report};
};

TEST_F(PolicySetTest, CallsEachPolicyInTheOrderAddedAndKeepsTheirTraits) {
  add("a", Trait::Retries);
  add("b", Trait::GradReady);
  set.run(&Policy::before_backward, ctx);
  EXPECT_EQ(log,
            (std::vector<std::string>{"a:add", "b:add", "a:before-backward", "b:before-backward"}));
  EXPECT_EQ(set.all().size(), 2u);
  EXPECT_TRUE(set.traits().has(Trait::Retries));
  EXPECT_TRUE(set.traits().has(Trait::GradReady));
  EXPECT_FALSE(set.traits().has(Trait::AllGradients));
}

TEST_F(PolicySetTest, RefusesAClashingPolicyBeforeItsOnAddAndKeepsNothingOfIt) {
  add("clip", Trait::AllGradients);
  frugal::testing::expect_error_contains([&] { add("in-backward", Trait::UpdatesInBackward); },
                                         "'in-backward'");
  EXPECT_EQ(log, std::vector<std::string>{"clip:add"});  // no on_add for the refused one
  EXPECT_EQ(set.all().size(), 1u);
  EXPECT_FALSE(set.traits().has(Trait::UpdatesInBackward));
}

TEST_F(PolicySetTest, RefusesWhatTheOptimizerCannotMeet) {
  PolicySet sharded(Traits(Trait::KeepsGradients));
  auto clip = std::make_shared<Recorder>("clip", log, Trait::AllGradients);
  EXPECT_THROW(sharded.add(clip, parts.port), std::exception);
  EXPECT_TRUE(sharded.all().empty());
  EXPECT_EQ(sharded.optimizer_traits(), Traits(Trait::KeepsGradients));
}

TEST_F(PolicySetTest, TheFirstPolicyThatRetriesWinsAndTheRestAreNotAsked) {
  auto a = add("a");
  auto b = add("b");
  auto c = add("c");
  const std::runtime_error error("out of memory");
  EXPECT_FALSE(set.retry(ctx, error));
  EXPECT_EQ(log.size(), 6u);  // 3 adds and 3 errors
  b->retries = true;
  log.clear();
  EXPECT_TRUE(set.retry(ctx, error));
  EXPECT_EQ(log, (std::vector<std::string>{"a:error", "b:error"}));
}

TEST_F(PolicySetTest, OptimizerErrorsReachEveryPolicyQuietlyOrLetAPolicyRaise) {
  auto a = add("a");
  auto b = add("b");
  a->raises = true;
  log.clear();
  const std::runtime_error error("step failed");
  set.optimizer_failed(ctx, error, /*quietly=*/true);
  EXPECT_EQ(log, (std::vector<std::string>{"a:optimizer-error", "b:optimizer-error"}));
  log.clear();
  frugal::testing::expect_error_contains(
      [&] { set.optimizer_failed(ctx, error, /*quietly=*/false); }, "a raised");
  EXPECT_EQ(log, std::vector<std::string>{"a:optimizer-error"});
}

TEST_F(PolicySetTest, GradientReadyCallsReachOnlyThoseThatDeclaredThem) {
  add("plain");
  add("hooked", Trait::GradReady);
  log.clear();
  const auto param = parts.model->parameters().front();
  set.grad_ready(ctx, param);
  set.grad_ready(ctx, param);
  EXPECT_EQ(log, (std::vector<std::string>{"hooked:ready", "hooked:ready"}));
}

TEST_F(PolicySetTest, EvaluationScopesEndInReverseAlsoWhenOneRefusesToBegin) {
  add("a");
  add("b");
  auto c = add("c");
  log.clear();
  { const PolicySet::Evaluation scopes(set, parts.port); }
  EXPECT_EQ(log, (std::vector<std::string>{"a:eval-begin", "b:eval-begin", "c:eval-begin",
                                           "c:eval-end", "b:eval-end", "a:eval-end"}));
  c->refuses_evaluation = true;
  log.clear();
  EXPECT_THROW(PolicySet::Evaluation(set, parts.port), std::runtime_error);
  EXPECT_EQ(log, (std::vector<std::string>{"a:eval-begin", "b:eval-begin", "c:eval-begin",
                                           "b:eval-end", "a:eval-end"}));
}

}  // namespace
