#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compat.h"
#include "frugal/compose/mixed_precision.h"
#include "frugal/policy/autocast.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::make_mlp;
namespace F = torch::nn::functional;

TEST(Autocast, Bf16PolicyLowersActivationsAndKeepsFloatParameters) {
  auto model = make_mlp(16, 32, 4);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  torch::ScalarType output_dtype = torch::kFloat;
  frugal::Trainer trainer(model, sgd, [&](const torch::Tensor& o, const torch::Tensor& t) {
    output_dtype = o.scalar_type();
    return F::mse_loss(o.to(torch::kFloat), t);
  }, frugal::TrainerOptions().set_to_none(false));
  trainer.add_policy(std::make_shared<frugal::AutocastPolicy>(torch::kCPU, torch::kBFloat16));
  trainer.step({torch::randn({8, 16}), torch::randn({8, 4})});
  EXPECT_EQ(output_dtype, torch::kBFloat16);
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  }
  EXPECT_FALSE(frugal::compat::autocast_enabled(torch::kCPU));  // left as it was
}

TEST(Autocast, EvaluationRunsUnderThePolicysAutocastAndLeavesItAsItWas) {
  auto model = make_mlp(16, 32, 4);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  std::vector<torch::ScalarType> seen;
  frugal::Trainer trainer(model, sgd, [&](const torch::Tensor& o, const torch::Tensor& t) {
    seen.push_back(o.scalar_type());
    return F::mse_loss(o.to(torch::kFloat), t);
  });
  const frugal::Batch data(torch::randn({8, 16}), torch::randn({8, 4}));
  const auto float32 = trainer.evaluate(data).loss;
  auto policy = std::make_shared<frugal::AutocastPolicy>(torch::kCPU, torch::kBFloat16);
  trainer.add_policy(policy);
  const auto bf16 = trainer.evaluate(data, /*batch_size=*/4).loss;  // two chunks
  policy->set_enabled(false);
  const auto off = trainer.evaluate(data).loss;
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen[0], torch::kFloat);
  EXPECT_EQ(seen[1], torch::kBFloat16);
  EXPECT_EQ(seen[2], torch::kBFloat16);
  EXPECT_EQ(seen[3], torch::kFloat);
  EXPECT_EQ(off, float32);
  EXPECT_NE(bf16, float32);  // bf16's rounding shows in the loss
  EXPECT_NEAR(bf16, float32, 0.05 * float32);
  EXPECT_FALSE(frugal::compat::autocast_enabled(torch::kCPU));  // left as it was
}

TEST(Autocast, NestedGuardsRestoreTheOuterState) {
  const auto a = torch::randn({4, 4});
  ASSERT_FALSE(frugal::compat::autocast_enabled(torch::kCPU));
  {
    frugal::AutocastGuard outer(torch::kCPU, torch::kBFloat16);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
    {
      frugal::AutocastGuard inner(torch::kCPU, torch::kBFloat16, /*enabled=*/false);
      EXPECT_FALSE(frugal::compat::autocast_enabled(torch::kCPU));
      EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
    }
    EXPECT_TRUE(frugal::compat::autocast_enabled(torch::kCPU));
    EXPECT_EQ(frugal::compat::autocast_dtype(torch::kCPU), torch::kBFloat16);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kBFloat16);
  }
  EXPECT_FALSE(frugal::compat::autocast_enabled(torch::kCPU));
  EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kFloat);
}

TEST(Autocast, Bf16StepPeakIsBelowTheFloat32StepByTheActivationsItHalves) {
  torch::manual_seed(2);
  const frugal::Batch batch{torch::randn({512, 64}), torch::randn({512, 8})};
  auto mse = [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::mse_loss(o.to(torch::kFloat), t);
  };
  frugal::MemoryProbe probe(torch::kCPU);
  std::int64_t activations = 0;
  std::int64_t weights = 0;
  {
    auto model = make_mlp(64, 1024, 8);
    const auto before = probe.allocated();
    auto loss = mse(model->forward(batch.inputs), batch.targets);
    activations = probe.allocated() - before;
    for (const auto& p : model->parameters()) {
      weights += p.numel() * 4;
    }
  }
  auto peak = [&](bool bf16) {
    auto model = make_mlp(64, 1024, 8);
    torch::optim::SGD sgd(model->parameters(), 0.01);
    frugal::Trainer trainer(model, sgd, mse);
    if (bf16) {
      EXPECT_EQ(frugal::use_mixed_precision(trainer, torch::kBFloat16), nullptr);  // no scaler
    }
    return trainer.step(batch).peak;
  };
  const auto fp32 = peak(false);
  const auto bf16 = peak(true);
  // bf16 halves the saved activations but caches bf16 copies of the weights (half their
  // bytes); at least half of that net saving must show in the peak.
  const std::int64_t expected = activations / 2 - weights / 2;
  ASSERT_GT(expected, 0);
  EXPECT_GE(fp32 - bf16, expected / 2)
      << "fp32 " << fp32 << " bf16 " << bf16 << " activations " << activations;
}

TEST(Autocast, Fp16OnTheCpuEitherRunsOrSaysWhichLibTorchItNeeds) {
  if (frugal::compat::autocast_supports(torch::kCPU, torch::kHalf)) {
    frugal::AutocastGuard fp16(torch::kCPU, torch::kHalf);
    const auto a = torch::randn({4, 4});
    EXPECT_EQ(torch::mm(a, a).scalar_type(), torch::kHalf);
    return;
  }
  try {
    frugal::AutocastPolicy policy(torch::kCPU, torch::kHalf);
    FAIL() << "fp16 CPU autocast accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Half needs LibTorch 2.4"), std::string::npos)
        << e.what();
  }
}

TEST(Autocast, Fp16MixedPrecisionAddsAScalerByDefault) {
  auto model = make_mlp(4, 4, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::mse_loss(o, t);
  }, frugal::TrainerOptions().device(torch::kCPU));
  if (!frugal::compat::autocast_supports(torch::kCPU, torch::kHalf)) {
    EXPECT_THROW(frugal::use_mixed_precision(trainer, torch::kHalf), c10::Error);
    return;
  }
  const auto scaler = frugal::use_mixed_precision(trainer, torch::kHalf);
  ASSERT_NE(scaler, nullptr);
  const auto report = trainer.step({torch::randn({8, 4}), torch::randn({8, 2})});
  EXPECT_EQ(report.scale, 65536.0);
}

TEST(CudaAutocast, Fp16StepWithScalerKeepsFloatGradients) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  auto model = make_mlp(16, 32, 4);
  model->to(torch::kCUDA);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  torch::ScalarType output_dtype = torch::kFloat;
  frugal::Trainer trainer(model, sgd, [&](const torch::Tensor& o, const torch::Tensor& t) {
    output_dtype = o.scalar_type();
    return F::mse_loss(o.to(torch::kFloat), t);
  }, frugal::TrainerOptions().device(torch::kCUDA).set_to_none(false));
  const auto scaler = frugal::use_mixed_precision(trainer, torch::kHalf);
  ASSERT_NE(scaler, nullptr);
  const auto report = trainer.step({torch::randn({8, 16}), torch::randn({8, 4})});
  EXPECT_EQ(output_dtype, torch::kHalf);
  EXPECT_FALSE(report.skipped);
  for (const auto& p : model->parameters()) {
    EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
  }
}

}  // namespace
