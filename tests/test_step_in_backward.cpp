#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>

#include "frugal/memory/ledger.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/sgd.h"
#include "frugal/policy/clip_grad.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/policy/step_in_backward.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::clone_all;
using frugal::testing::expect_all_close;
using frugal::testing::make_mlp;
namespace F = torch::nn::functional;
namespace to = torch::optim;

using frugal::testing::mse;

frugal::Batch batch_at(int step, std::int64_t n = 24) {
  torch::manual_seed(100 + step);
  return {torch::randn({n, 10}), torch::randn({n, 3})};
}

enum class Kind { Sgd, Adam };

std::unique_ptr<to::Optimizer> make_optimizer(Kind kind, torch::nn::Module& model) {
  if (kind == Kind::Sgd) {
    return std::make_unique<frugal::optim::SGD>(model.parameters(),
                                                to::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_unique<frugal::optim::Adam>(model.parameters(),
                                               to::AdamOptions(1e-2).weight_decay(1e-3));
}

// Weights after 20 steps, with or without the optimizer step in backward.
std::vector<torch::Tensor> train_20(Kind kind, frugal::TrainerOptions options, bool in_backward,
                                    std::vector<double>* losses = nullptr) {
  auto model = make_mlp(10, 32, 3);
  auto optimizer = make_optimizer(kind, *model);
  frugal::Trainer trainer(model, *optimizer, mse, options);
  if (in_backward) {
    trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  }
  for (int step = 0; step < 20 * options.accumulate(); ++step) {
    const auto report = trainer.step(batch_at(step));
    if (losses != nullptr) {
      losses->push_back(report.loss);
    }
  }
  EXPECT_EQ(trainer.steps(), 20);
  return clone_all(model->parameters());
}

TEST(StepInBackward, SameWeightsAsTheOrdinaryStepAfter20Steps) {
  const std::vector<std::pair<const char*, frugal::TrainerOptions>> setups = {
      {"whole batch", frugal::TrainerOptions()},
      {"micro-batches", frugal::TrainerOptions().micro_batch(7)},
      {"micro-batches + accumulate(2)", frugal::TrainerOptions().micro_batches(3).accumulate(2)},
  };
  for (const auto kind : {Kind::Sgd, Kind::Adam}) {
    for (const auto& [name, options] : setups) {
      SCOPED_TRACE(name);
      SCOPED_TRACE(kind == Kind::Sgd ? "SGD" : "Adam");
      std::vector<double> plain_losses, fused_losses;
      const auto plain = train_20(kind, options, false, &plain_losses);
      const auto fused = train_20(kind, options, true, &fused_losses);
      expect_all_close(fused, plain, 1e-6, 1e-7);
      ASSERT_EQ(fused_losses.size(), plain_losses.size());
      EXPECT_NEAR(fused_losses.back(), plain_losses.back(), 1e-6 * std::abs(plain_losses.back()));
    }
  }
}

// Records, at each gradient-ready call, the gradient bytes alive then.
struct GradientWatch : frugal::Policy {
  std::string name() const override { return "gradient-watch"; }
  frugal::Traits traits() const override { return frugal::Trait::GradReady; }
  void on_grad_ready(frugal::StepContext& ctx, const torch::Tensor&) override {
    ++calls;
    most = std::max(most, frugal::measure_ledger(ctx.probe, ctx.module).gradients);
  }
  void after_backward(frugal::StepContext& ctx) override {
    at_end = frugal::measure_ledger(ctx.probe, ctx.module).gradients;
  }
  int calls = 0;
  std::int64_t most = 0;
  std::int64_t at_end = -1;
};

TEST(StepInBackward, AtMostOneParametersGradientIsAlive) {
  auto model = make_mlp(10, 256, 3);
  frugal::optim::Adam adam(model->parameters());
  frugal::Trainer trainer(model, adam, mse);
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  auto watch = std::make_shared<GradientWatch>();
  trainer.add_policy(watch);  // after StepInBackward: sees each gradient freed
  trainer.step(batch_at(0));
  std::int64_t largest = 0, all = 0;
  for (const auto& p : model->parameters()) {
    largest = std::max<std::int64_t>(largest, p.numel() * p.element_size());
    all += p.numel() * p.element_size();
  }
  EXPECT_EQ(watch->calls, static_cast<int>(model->parameters().size()));
  EXPECT_LE(watch->most, largest);
  EXPECT_EQ(watch->at_end, 0) << "of " << all << " gradient bytes";
}

TEST(StepInBackward, GradientReadyCallsComeOnlyInTheBackwardThatCompletesTheStep) {
  auto model = make_mlp(10, 32, 3);
  frugal::optim::SGD sgd(model->parameters(), to::SGDOptions(0.1));
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().micro_batches(3).accumulate(2));
  auto watch = std::make_shared<GradientWatch>();
  trainer.add_policy(watch);
  const int params = static_cast<int>(model->parameters().size());
  trainer.step(batch_at(0));  // three micro-batches, the window not complete: no calls
  EXPECT_EQ(watch->calls, 0);
  trainer.step(batch_at(1));  // completes it: one call per parameter, in the last backward
  EXPECT_EQ(watch->calls, params);
  trainer.trial(batch_at(2));  // a trial measures the completing backward too
  EXPECT_EQ(watch->calls, 2 * params);
}

TEST(StepInBackward, ATrialChangesNoParameter) {
  auto model = make_mlp(10, 32, 3);
  frugal::optim::Adam adam(model->parameters());
  frugal::Trainer trainer(model, adam, mse);
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  const auto before = clone_all(model->parameters());
  const auto report = trainer.trial(batch_at(0));
  EXPECT_GT(report.peak, 0);
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(model->parameters()[i], before[i]));
    EXPECT_FALSE(model->parameters()[i].grad().defined());
  }
  EXPECT_TRUE(adam.state().empty());
}

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(StepInBackward, RefusesWhatNeedsAllGradientsOrALibTorchOptimizer) {
  auto model = make_mlp(10, 32, 3);
  torch::optim::Adam torch_adam(model->parameters());
  frugal::Trainer plain(model, torch_adam, mse);
  EXPECT_NE(error_of([&] { plain.add_policy(std::make_shared<frugal::StepInBackward>()); })
                .find("frugal::optim::SGD, Adam or AdamW"),
            std::string::npos);

  frugal::optim::Adam adam(model->parameters());
  auto scaler = std::make_shared<frugal::GradScaler>();
  const std::vector<std::shared_ptr<frugal::Policy>> needing_all = {
      std::make_shared<frugal::GradScalerPolicy>(scaler),
      std::make_shared<frugal::ClipGrad>(frugal::ClipGradOptions().max_norm(1.0))};
  for (const auto& other : needing_all) {
    for (const bool sib_first : {true, false}) {
      frugal::Trainer trainer(model, adam, mse);
      auto sib = std::make_shared<frugal::StepInBackward>();
      trainer.add_policy(sib_first ? sib : other);
      const auto message = error_of([&] { trainer.add_policy(sib_first ? other : sib); });
      const auto needing = fmt::format("'{}' needs every gradient", other->name());
      EXPECT_NE(message.find(needing), std::string::npos) << message;
      EXPECT_NE(message.find("'step-in-backward' updates parameters during backward"),
                std::string::npos)
          << message;
      EXPECT_EQ(trainer.policies().size(), 1u);
    }
  }
}

TEST(StepInBackward, AFailureMidBackwardNamesTheParametersItUpdated) {
  auto model = make_mlp(10, 32, 3);  // Sequential: 0 (Linear), 1 (Tanh), 2 (Linear)
  frugal::optim::SGD sgd(model->parameters(), to::SGDOptions(0.1));
  bool fail = true;
  frugal::Trainer trainer(
      model.ptr(), sgd,
      [&](const torch::Tensor& x) {
        auto hidden = model[1]->as<torch::nn::Tanh>()->forward(
            model[0]->as<torch::nn::Linear>()->forward(x));
        // Fails in backward after the output layer (2.*) got its gradient and update.
        hidden.register_hook([&](torch::Tensor g) {
          TORCH_CHECK(!fail, "injected failure in backward");
          return g;
        });
        return model[2]->as<torch::nn::Linear>()->forward(hidden);
      },
      mse);
  trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  const auto before = clone_all(model->parameters());
  try {
    trainer.step(batch_at(0));
    FAIL() << "the step should fail";
  } catch (const frugal::PartialStepError& e) {
    auto updated = e.updated;  // in the order autograd reached them
    std::sort(updated.begin(), updated.end());
    EXPECT_EQ(updated, (std::vector<std::string>{"2.bias", "2.weight"}));
    EXPECT_NE(std::string(e.what()).find("injected failure in backward"), std::string::npos);
  }
  const auto named = model->named_parameters();
  EXPECT_TRUE(torch::equal(named["0.weight"], before[0]));
  EXPECT_TRUE(torch::equal(named["0.bias"], before[1]));
  EXPECT_FALSE(torch::equal(named["2.weight"], before[2]));
  EXPECT_EQ(trainer.steps(), 0);
  // The trainer halts until the caller accepts the partial update.
  EXPECT_THROW(trainer.step(batch_at(1)), c10::Error);
  EXPECT_EQ(trainer.steps(), 0);
  trainer.accept_partial_update();
  fail = false;  // the trainer goes on from there
  EXPECT_TRUE(trainer.step(batch_at(1)).stepped);
  EXPECT_EQ(trainer.steps(), 1);
  EXPECT_FALSE(torch::equal(named["0.weight"], before[0]));
}

TEST(StepInBackward, LowersTheStepPeakByTheGradientsItNeverHolds) {
  // Eight square layers and a small batch: at the end of an ordinary backward all eight
  // weight gradients are alive; in backward, one at a time.
  frugal::MemoryProbe probe(torch::kCPU);  // counts from here: both models' weights too
  std::int64_t grads = 0, largest = 0;
  auto peak_of = [&](bool in_backward) {
    torch::manual_seed(1);
    torch::nn::Sequential model;
    for (int i = 0; i < 8; ++i) {
      model->push_back(torch::nn::Linear(256, 256));
      model->push_back(torch::nn::Tanh());
    }
    grads = largest = 0;
    for (const auto& p : model->parameters()) {
      grads += p.numel() * p.element_size();
      largest = std::max<std::int64_t>(largest, p.numel() * p.element_size());
    }
    frugal::optim::SGD sgd(model->parameters(), to::SGDOptions(0.01));
    frugal::Trainer trainer(model, sgd, mse);
    if (in_backward) {
      trainer.add_policy(std::make_shared<frugal::StepInBackward>());
    }
    return trainer.step({torch::randn({8, 256}), torch::randn({8, 256})}).peak;
  };
  const auto plain = peak_of(false);
  const auto fused = peak_of(true);
  // Saved: every gradient but the one in flight and the one being produced.
  EXPECT_GE(plain - fused, grads - 2 * largest) << "plain " << plain << " fused " << fused;
}

}  // namespace
