// The one table of traits that cannot meet: every refused pair, in a trainer and alone.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "engine/compatibility.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/zero.h"
#include "frugal/error.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/sgd.h"
#include "frugal/policy/clip_grad.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/policy/step_in_backward.h"
#include "frugal/train/trainer.h"

namespace {

using frugal::Trait;
using frugal::Traits;

std::string refusal_of(const std::vector<frugal::detail::Party>& present,
                       const frugal::detail::Party& added) {
  try {
    frugal::detail::check_compatible(present, added);
  } catch (const frugal::Error& e) {
    return e.what();
  }
  return "";
}

// A policy with the traits it is given, to try each rule with parties that have nothing else.
struct Declares : frugal::Policy {
  Declares(std::string name, Traits traits) : name_(std::move(name)), traits_(traits) {}
  std::string name() const override { return name_; }
  Traits traits() const override { return traits_; }
  std::string name_;
  Traits traits_;
};

TEST(Compatibility, EveryRuleRefusesItsPairNamingBothPartiesAndTheRule) {
  for (const auto& rule : frugal::detail::compatibility_rules()) {
    const frugal::detail::Party first{"'first-party'", rule.first};
    const frugal::detail::Party second{"'second-party'", rule.second};
    const auto message = refusal_of({first}, second);
    ASSERT_FALSE(message.empty()) << frugal::trait_name(rule.first) << " then "
                                  << frugal::trait_name(rule.second);
    EXPECT_NE(message.find("'first-party' and 'second-party' cannot work together"),
              std::string::npos)
        << message;
    const auto named = fmt::format("(rule {} / {})", frugal::trait_name(rule.first),
                                   frugal::trait_name(rule.second));
    EXPECT_NE(message.find(named), std::string::npos) << message;
    // The other order: refused too where the rule says so, and then with the roles kept.
    const auto reversed = refusal_of({second}, first);
    EXPECT_EQ(reversed.empty(), !rule.either_order) << reversed;
    if (rule.either_order) {
      EXPECT_NE(reversed.find("'first-party' and 'second-party'"), std::string::npos) << reversed;
    }
  }
}

TEST(Compatibility, TraitsNoRuleNamesGoTogether) {
  const Traits all = Trait::GradReady | Trait::AllGradients | Trait::Retries |
                     Trait::UpdatesInBackward | Trait::OwnsNonFinite | Trait::SharesGradients |
                     Trait::KeepsGradients;
  // Each trait beside itself, and the unruled ones beside everything.
  for (const Trait t : {Trait::GradReady, Trait::OwnsNonFinite}) {
    EXPECT_EQ(refusal_of({{"'a'", t}}, {"'b'", all}), "") << frugal::trait_name(t);
    EXPECT_EQ(refusal_of({{"'a'", all}}, {"'b'", t}), "") << frugal::trait_name(t);
  }
  EXPECT_EQ(refusal_of({{"'a'", Trait::AllGradients}}, {"'b'", Trait::AllGradients}), "");
  EXPECT_EQ(refusal_of({{"'a'", Trait::SharesGradients}}, {"'b'", Trait::AllGradients}), "");
  EXPECT_EQ(refusal_of({{"'a'", Trait::SharesGradients}}, {"'b'", Trait::Retries}), "");
  // ZeRO-3 stepping in backward updates from gradients already averaged: DataParallel fits.
  const Traits zero =
      Trait::KeepsGradients | Trait::ShardsParameters | Trait::UpdatesSharesInBackward;
  EXPECT_EQ(refusal_of({{"'a'", zero}}, {"'b'", Trait::GradReady | Trait::SharesGradients}), "");
}

TEST(Compatibility, TheTrainerRefusesAPolicyAndKeepsTheOnesBefore) {
  torch::nn::Linear model(4, 2);
  frugal::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  frugal::Trainer trainer(model, sgd, torch::nn::functional::mse_loss);
  trainer.add_policy(std::make_shared<Declares>("reader", Trait::AllGradients));
  try {
    trainer.add_policy(std::make_shared<Declares>("writer", Trait::UpdatesInBackward));
    FAIL() << "accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'reader' and 'writer' cannot work together"),
              std::string::npos)
        << e.what();
  }
  ASSERT_EQ(trainer.policies().size(), 1u);
  EXPECT_TRUE(trainer.traits().has(Trait::AllGradients));
  EXPECT_FALSE(trainer.traits().has(Trait::UpdatesInBackward));
}

TEST(Compatibility, ARankKeepingItsShareOfTheGradientsRefusesAPolicyThatReadsThemAll) {
  torch::nn::Linear model(4, 2);
  auto group = frugal::distributed::Group::single();
  auto make = [](std::vector<torch::Tensor> shard) {
    return std::make_unique<frugal::optim::SGD>(shard, torch::optim::SGDOptions(0.1));
  };
  for (const int stage : {1, 2, 3}) {
    frugal::distributed::ZeroOptimizer zero(
        model->parameters(), group, make, frugal::distributed::ZeroOptimizerOptions().stage(stage));
    frugal::Trainer trainer(model, zero, torch::nn::functional::mse_loss);
    trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(group));
    std::string message;
    try {
      trainer.add_policy(
          std::make_shared<frugal::ClipGrad>(frugal::ClipGradOptions().max_norm(1.0)));
    } catch (const frugal::Error& e) {
      message = e.what();
    }
    if (stage == 1) {
      EXPECT_EQ(message, "");
    } else {
      EXPECT_NE(message.find("'clip-grad' reads every gradient, but under the optimizer each "
                             "rank keeps only its share"),
                std::string::npos)
          << message;
    }
  }
}

TEST(Compatibility, FrugalsPoliciesDeclareWhatTheEngineArrangesForThem) {
  auto scaler = std::make_shared<frugal::GradScaler>();
  EXPECT_EQ(frugal::GradScalerPolicy(scaler).traits(), Trait::AllGradients | Trait::OwnsNonFinite);
  EXPECT_EQ(frugal::ClipGrad(frugal::ClipGradOptions().max_norm(1.0)).traits(),
            Traits(Trait::AllGradients));
  EXPECT_EQ(frugal::OomRecovery().traits(), Traits(Trait::Retries));
  EXPECT_EQ(frugal::StepInBackward().traits(), Trait::GradReady | Trait::UpdatesInBackward);
  EXPECT_EQ(frugal::distributed::DataParallel(frugal::distributed::Group::single()).traits(),
            Trait::GradReady | Trait::SharesGradients);
}

}  // namespace
