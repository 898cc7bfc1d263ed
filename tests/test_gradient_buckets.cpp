// DataParallel's buckets of bfloat16 gradients: each is filled in the dtype the backend sums
// in (float32 on Gloo before LibTorch 2.2, which cannot sum bfloat16) and sent from there, so
// a bucket in flight costs its sent bytes and nothing more; the averaged gradient is the sum
// rounded once to bfloat16.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include "dist_launch.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/memory/probe.h"
#include "frugal/train/trainer.h"

// Named: in a unity batch an anonymous namespace would share its names with other files'.
namespace frugal::testing::gradient_buckets {

constexpr std::int64_t kIn = 16;
constexpr std::int64_t kOut = 16;
constexpr std::int64_t kRows = 6;  // a rank's share of the batch

// Gloo sums bfloat16 from LibTorch 2.2 on.
constexpr bool kGlooSumsBf16 = TORCH_VERSION_MAJOR > 2 ||
                               (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2);

torch::nn::Linear bf16_model() {
  torch::manual_seed(3);
  torch::nn::Linear model(kIn, kOut);
  model->to(torch::kBFloat16);
  return model;
}

// In float32 (LibTorch 1.13 has no bfloat16 mse_loss on the CPU).
torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::mse_loss(out.to(torch::kFloat), y.to(torch::kFloat));
}

// A rank's inputs and targets: rank r takes row block r of one seeded batch.
std::pair<torch::Tensor, torch::Tensor> share(int rank) {
  torch::manual_seed(4);
  const auto x = torch::randn({2, kRows, kIn}).to(torch::kBFloat16);
  const auto y = torch::randn({2, kRows, kOut}).to(torch::kBFloat16);
  return {x[rank], y[rank]};
}

// What the ranks should agree on: each share's own gradients, averaged and rounded once.
std::vector<torch::Tensor> expected_average() {
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < 2; ++r) {
    auto model = bf16_model();
    const auto [x, y] = share(r);
    mse(model(x), y).backward();
    const auto params = model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto half = params[i].grad().to(torch::kFloat) * 0.5;
      if (sum.size() <= i) {
        sum.push_back(half);
      } else {
        sum[i] += half;
      }
    }
  }
  for (auto& s : sum) {
    s = s.to(torch::kBFloat16);
  }
  return sum;
}

// One step on this rank's share; returns the averaged gradients, then the bytes the gradients
// took once backward had handed them over (in buckets between ranks, on the parameters in a
// group of one), the number of buckets and the dtype the group sums bfloat16 in.
std::vector<torch::Tensor> step(const std::shared_ptr<frugal::distributed::Group>& group) {
  auto model = bf16_model();
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  frugal::Trainer trainer(model, optimizer, mse);
  // The weight alone fills a bucket of float32: sent as bfloat16, weight and bias share one.
  auto dp = std::make_shared<frugal::distributed::DataParallel>(
      group, frugal::distributed::DataParallelOptions().bucket_bytes(kIn * kOut * 4));
  trainer.add_policy(dp);
  const frugal::MemoryProbe probe(torch::kCPU);
  std::int64_t before = 0;
  std::int64_t handed_over = 0;
  std::vector<torch::Tensor> out;
  trainer.add_hook(frugal::Phase::BeforeBackward,
                   [&](frugal::StepContext&) { before = probe.allocated(); });
  trainer.add_hook(frugal::Phase::AfterBackward,
                   [&](frugal::StepContext&) { handed_over = probe.allocated() - before; });
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext& c) {
    for (const auto& p : c.module.parameters()) {
      out.push_back(p.grad().clone());
    }
  });
  const auto [x, y] = share(group->rank());
  trainer.step({x, y});
  const auto summed = group->summed_dtype(torch::kBFloat16);
  out.push_back(torch::tensor({handed_over, static_cast<std::int64_t>(dp->buckets().size()),
                               static_cast<std::int64_t>(summed)}));
  return out;
}

const auto register_step = frugal::testing::register_rank_training("bucket-step", step);

TEST(GradientBuckets, Bf16GradientsTravelInTheDtypeTheBackendSumsAndAverageToOneRounding) {
  const auto ranks = launch_and_load("bucket-step", 2);
  ASSERT_EQ(ranks.size(), 2u) << "a rank failed";
  const auto alone = step(frugal::distributed::Group::single());
  const auto want = expected_average();
  const std::int64_t numel = kIn * kOut + kOut;
  const auto summed = kGlooSumsBf16 ? torch::kBFloat16 : torch::kFloat;
  const std::int64_t sent = static_cast<std::int64_t>(c10::elementSize(summed));
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto& got = ranks[r];
    ASSERT_EQ(got.size(), want.size() + 1);
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), torch::kBFloat16);
      EXPECT_TRUE(torch::equal(got[i], want[i]))
          << "parameter " << i << " differs by "
          << (got[i].to(torch::kFloat) - want[i].to(torch::kFloat)).abs().max().item<float>();
    }
    const auto numbers = got.back();
    EXPECT_EQ(numbers[2].item<std::int64_t>(), static_cast<std::int64_t>(summed));
    // Weight and bias in one bucket of bfloat16, or in two of float32.
    EXPECT_EQ(numbers[1].item<std::int64_t>(), kGlooSumsBf16 ? 1 : 2);
    // After backward the gradients are in the buckets, in the sent dtype, and nowhere else:
    // against a group of one, where they stay on the parameters in bfloat16, that is the
    // difference of the two dtypes' sizes (no second, wider copy to send), and the ranks'
    // counts summed where the buckets are, with the weight they give (two float64 scalars,
    // kept until finalize reads them).
    const auto in_buckets = numbers[0].item<std::int64_t>();
    const auto on_parameters = alone.back()[0].item<std::int64_t>();
    const std::int64_t agreement = 2 * static_cast<std::int64_t>(sizeof(double));
    EXPECT_EQ(in_buckets - on_parameters, numel * (sent - 2) + agreement)
        << in_buckets << " B in buckets, " << on_parameters << " B on the parameters";
  }
}

}  // namespace frugal::testing::gradient_buckets
