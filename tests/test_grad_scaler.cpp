#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

#include "frugal/policy/clip_grad.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::clone_all;
using frugal::testing::expect_all_close;
namespace F = torch::nn::functional;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// One parameter whose gradient the test sets by hand.
struct Manual {
  torch::Tensor param = torch::zeros({20, 20}, torch::requires_grad());
  torch::optim::SGD sgd{{param}, 1.0};

  void set_grad(const torch::Tensor& g) { param.mutable_grad() = g; }
};

TEST(GradScaler, UpdateRuleGrowsAfterTheIntervalAndBacksOffOnInf) {
  frugal::GradScaler scaler(frugal::GradScalerOptions()
                                .init_scale(4.0)
                                .growth_factor(2.0)
                                .backoff_factor(0.25)
                                .growth_interval(2));
  Manual m;
  auto iteration = [&](float value) {
    (void)scaler.scale(torch::ones({}));
    m.set_grad(torch::full({20, 20}, value));
    scaler.step(m.sgd);
    scaler.update();
    return std::make_pair(scaler.growth_tracker(), scaler.get_scale());
  };
  EXPECT_EQ(iteration(1.0f), std::make_pair(std::int64_t{1}, 4.0));
  EXPECT_EQ(iteration(1.0f), std::make_pair(std::int64_t{0}, 8.0));
  EXPECT_EQ(iteration(kInf), std::make_pair(std::int64_t{0}, 2.0));
}

TEST(GradScaler, UnscaleTurnsScaledGradientsBackIntoTrueOnes) {
  frugal::GradScaler scaler(frugal::GradScalerOptions().init_scale(4.0));
  Manual m;
  (void)scaler.scale(torch::ones({}));
  m.set_grad(torch::full({20, 20}, 4.0f));
  scaler.unscale_(m.sgd);
  EXPECT_TRUE(torch::allclose(m.param.grad(), torch::ones({20, 20}), 1e-5, 1e-7));
  EXPECT_TRUE(scaler.step(m.sgd));  // finite: the optimizer steps
}

TEST(GradScaler, DetectsInfAndNaNInContiguousTransposedAndSlicedGradients) {
  for (const float bad : {kInf, kNaN}) {
    for (const std::string layout : {"contiguous", "transposed", "sliced"}) {
      SCOPED_TRACE(layout + (std::isnan(bad) ? " nan" : " inf"));
      frugal::GradScaler scaler(frugal::GradScalerOptions().init_scale(4.0));
      Manual m;
      (void)scaler.scale(torch::ones({}));
      torch::Tensor g;
      if (layout == "contiguous") {
        g = torch::full({20, 20}, 4.0f);
        g[3][7] = bad;
      } else if (layout == "transposed") {
        g = torch::full({20, 20}, 4.0f);
        g[7][3] = bad;
        g = g.t();
      } else {
        auto wide = torch::full({20, 30}, 4.0f);
        wide[5][12] = bad;
        g = wide.narrow(1, 0, 20);
      }
      ASSERT_EQ(g.is_contiguous(), layout == "contiguous");
      m.set_grad(g);
      const auto before = m.param.detach().clone();
      EXPECT_FALSE(scaler.step(m.sgd));
      EXPECT_TRUE(torch::equal(m.param.detach(), before));
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), 2.0);
    }
  }
}

TEST(GradScaler, UnscaleTwiceOrAfterStepIsAnError) {
  frugal::GradScaler scaler;
  Manual m;
  (void)scaler.scale(torch::ones({}));
  m.set_grad(torch::ones({20, 20}));
  scaler.unscale_(m.sgd);
  try {
    scaler.unscale_(m.sgd);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already been called"), std::string::npos);
  }
  scaler.step(m.sgd);
  EXPECT_THROW(scaler.unscale_(m.sgd), c10::Error);
}

TEST(GradScaler, BadOptionsNameTheValue) {
  for (const auto& [options, needle] :
       std::vector<std::pair<frugal::GradScalerOptions, std::string>>{
           {frugal::GradScalerOptions().growth_factor(1.0), "growth_factor must be > 1, got 1"},
           {frugal::GradScalerOptions().growth_factor(0.5), "got 0.5"},
           {frugal::GradScalerOptions().backoff_factor(1.0), "backoff_factor must be in (0, 1)"},
           {frugal::GradScalerOptions().growth_interval(0), "growth_interval must be >= 1"}}) {
    try {
      frugal::GradScaler scaler(options);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
}

TEST(GradScaler, DisabledScalerIsANoOpWithScaleOne) {
  frugal::GradScaler scaler(frugal::GradScalerOptions().enabled(false));
  const auto loss = torch::full({}, 3.0);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  Manual m;
  m.set_grad(torch::full({20, 20}, kInf));
  EXPECT_TRUE(scaler.step(m.sgd));  // not checked: a disabled scaler does not skip
  EXPECT_TRUE(scaler.state_dict().empty());
}

TEST(GradScaler, StateDictRoundTripBeforeAndAfterLazyInit) {
  frugal::GradScaler source(frugal::GradScalerOptions().init_scale(256.0).growth_interval(1));
  const auto lazy = source.state_dict();
  EXPECT_EQ(lazy.at("scale"), 256.0);
  EXPECT_EQ(lazy.at("_growth_tracker"), 0.0);

  frugal::GradScaler target;
  target.load_state_dict(lazy);
  EXPECT_EQ(target.get_scale(), 256.0);
  EXPECT_EQ(target.options().growth_interval(), 1);

  Manual m;
  (void)source.scale(torch::ones({}));
  m.set_grad(torch::ones({20, 20}));
  source.step(m.sgd);
  source.update();  // interval 1: grows to 512
  const auto live = source.state_dict();
  EXPECT_EQ(live.at("scale"), 512.0);

  (void)target.scale(torch::ones({}));  // initialised: load must fill the live tensors
  target.load_state_dict(live);
  EXPECT_EQ(target.get_scale(), 512.0);
  EXPECT_EQ(target.growth_tracker(), 0);
  EXPECT_THROW(target.load_state_dict({}), c10::Error);
}

// Sequential(Linear(8,8), Linear(8,8)), SGD lr 1, MSE, 4 batches of 8x8, an inf injected
// into a gradient at iteration 2.
struct ScalerRun {
  std::vector<torch::Tensor> weights;
  std::vector<torch::Tensor> weights_before_skip;
  std::vector<torch::Tensor> weights_after_skip;
  double scale = 0;
  std::int64_t skipped = 0;
};

ScalerRun run_with_inf_at_iteration_two(bool scaled, std::int64_t micro_batch) {
  torch::manual_seed(21);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  std::vector<frugal::Batch> batches;
  for (int i = 0; i < 4; ++i) {
    batches.push_back({torch::randn({8, 8}), torch::randn({8, 8})});
  }
  torch::optim::SGD sgd(model->parameters(), 1.0);
  frugal::Trainer trainer(model, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::mse_loss(o, t);
  }, frugal::TrainerOptions().micro_batch(micro_batch));
  std::shared_ptr<frugal::GradScaler> scaler;
  if (scaled) {
    scaler = std::make_shared<frugal::GradScaler>(
        frugal::GradScalerOptions().init_scale(128.0).growth_interval(1));
    trainer.add_policy(std::make_shared<frugal::GradScalerPolicy>(scaler));
  }
  int iteration = 0;
  trainer.add_hook(frugal::Phase::AfterBackward, [&](frugal::StepContext& c) {
    if (iteration == 2 && c.micro_index == 0) {
      c.module.parameters()[0].mutable_grad()[0][0] = kInf;
    }
  });
  if (!scaled) {  // the unscaled reference skips the same step by hand
    trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext& c) {
      c.skip_optimizer_step = iteration == 2;
    });
  }
  ScalerRun run;
  for (iteration = 1; iteration <= 4; ++iteration) {
    if (iteration == 2) {
      run.weights_before_skip = clone_all(model->parameters());
    }
    const auto report = trainer.step(batches[iteration - 1]);
    if (iteration == 2) {
      run.weights_after_skip = clone_all(model->parameters());
      EXPECT_TRUE(report.skipped);
    }
    run.scale = report.scale;
    run.skipped = report.skipped_total;
  }
  run.weights = clone_all(model->parameters());
  return run;
}

TEST(GradScaler, SkippedStepMatchesAnUnscaledRunThatSkipsTheSameStep) {
  const auto scaled = run_with_inf_at_iteration_two(true, 8);
  const auto plain = run_with_inf_at_iteration_two(false, 8);
  EXPECT_EQ(scaled.skipped, 1);
  EXPECT_EQ(scaled.scale, 128.0 * 8.0 * 0.5);  // 128 * 2^3 unskipped * 0.5^1 skipped
  expect_all_close(scaled.weights_after_skip, scaled.weights_before_skip, 0, 0);
  expect_all_close(scaled.weights, plain.weights, 1e-5, 1e-7);
}

TEST(GradScaler, AccumulationWithTheScalerEqualsAccumulationWithout) {
  const auto scaled = run_with_inf_at_iteration_two(true, 4);  // 2 micro-batches
  const auto plain = run_with_inf_at_iteration_two(false, 4);
  expect_all_close(scaled.weights, plain.weights, 1e-5, 1e-7);
}

TEST(ClipGrad, ClipsTheTrueGradientsWhateverThePolicyOrder) {
  auto run = [](bool scaled, bool clip_first) {
    torch::manual_seed(3);
    torch::nn::Linear model(8, 4);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    frugal::Trainer trainer(model, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
      return F::mse_loss(o, t) * 100.0;  // large gradients: clipping matters
    });
    auto scaler = std::make_shared<frugal::GradScaler>(
        frugal::GradScalerOptions().enabled(scaled).init_scale(1024.0));
    auto clip = std::make_shared<frugal::ClipGrad>(frugal::ClipGradOptions().max_norm(0.5));
    if (clip_first) {
      trainer.add_policy(clip).add_policy(std::make_shared<frugal::GradScalerPolicy>(scaler));
    } else {
      trainer.add_policy(std::make_shared<frugal::GradScalerPolicy>(scaler)).add_policy(clip);
    }
    trainer.step({torch::randn({16, 8}), torch::randn({16, 4})});
    return std::make_pair(clone_all(model->parameters()), clip->last_norm());
  };
  const auto plain = run(false, false);
  EXPECT_GT(plain.second, 0.5);
  for (const bool clip_first : {true, false}) {
    const auto scaled = run(true, clip_first);
    EXPECT_NEAR(scaled.second, plain.second, 1e-4 * plain.second);
    expect_all_close(scaled.first, plain.first, 1e-5, 1e-7);
  }
}

}  // namespace
