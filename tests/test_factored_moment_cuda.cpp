// The factored second moment's step on CUDA (tensor operations) against the CPU's fused
// step: the same statistics, and weights within float32 rounding, or on bfloat16 weights
// apart by independent stochastic roundings only.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "frugal/optim/adam8bit.h"
#include "helpers.h"
#include "optim8bit_setup.h"

namespace {

namespace to = torch::optim;
namespace fo = frugal::optim;
using frugal::testing::optim8bit::kFactored;
using frugal::testing::optim8bit::state_of;

// Two runs of the same bfloat16 steps from `start`, each rounding up or down at random,
// unbiased, by less than a gap (2^-7 of the weight's binade) and drawing other bits: their
// weights `a` and `b` walk apart by independent roundings, the difference's variance at most
// gap^2 / 2 a step. A weight's gap is that of the largest binade it can have visited: of its
// start or either end (or 1/16, for weights that pass near zero, whose gaps in small binades
// would count a normal walk as huge). In gaps: the mean within 5 standard errors of 0, the
// root mean square within sqrt(steps / 2) and a quarter.
void expect_independent_roundings(const torch::Tensor& start, const torch::Tensor& a,
                                  const torch::Tensor& b, int steps) {
  const auto largest =
      torch::maximum(torch::maximum(start.abs(), a.abs()), b.abs()).clamp_min(1.0 / 16);
  const auto gap = torch::pow(2.0, torch::floor(torch::log2(largest)) - 7);
  const auto apart = (b - a) / gap;
  const double walk = std::sqrt(steps / 2.0);
  EXPECT_LE(apart.pow(2).mean().sqrt().item<double>(), 1.25 * walk);
  EXPECT_LE(std::abs(apart.mean().item<double>()),
            5 * walk / std::sqrt(static_cast<double>(apart.numel())));
}

// The test's data and steps: 20 steps of AdamW8bit with the factored second moment on a
// 150 x 60 matrix from seed 12; the weights at the start, and the optimizer's weights after.
torch::Tensor twenty_steps(torch::Tensor weights, double beta1,
                           const fo::InPlaceOptions& in_place) {
  std::vector<torch::Tensor> params{weights.requires_grad_()};
  fo::AdamW8bit adamw(params, to::AdamWOptions(1e-2).betas({beta1, 0.999}).weight_decay(0.01),
                      kFactored, in_place);
  torch::manual_seed(13);
  for (int step = 0; step < 20; ++step) {
    params[0].mutable_grad() =
        (torch::randn({150, 60}) * (1 + step % 3)).to(params[0].dtype()).to(params[0].device());
    adamw.step();
  }
  return params[0].detach().cpu().to(torch::kFloat32);
}

TEST(FactoredMoment, TwoCpuRunsRoundingWithOtherBitsPassTheCudaTestsStatistic) {
  // The statistic of the CUDA test below, on two CPU runs that differ only in their rounding
  // bits (as the CPU's and CUDA's do), over many seeds: it holds for every one.
  for (const double beta1 : {0.9, 0.0}) {
    torch::manual_seed(12);
    const auto start = torch::randn({150, 60}).to(torch::kBFloat16);
    for (std::uint64_t seed = 1; seed <= 16; ++seed) {
      SCOPED_TRACE("beta1 " + std::to_string(beta1) + ", seed " + std::to_string(seed));
      const auto a = twenty_steps(
          start.clone(), beta1, fo::InPlaceOptions(frugal::testing::optim8bit::kChunks).seed(seed));
      const auto b =
          twenty_steps(start.clone(), beta1,
                       fo::InPlaceOptions(frugal::testing::optim8bit::kChunks).seed(seed + 100));
      ASSERT_FALSE(torch::equal(a, b));  // the bits differ, so the walks do
      expect_independent_roundings(start.to(torch::kFloat32), a, b, 20);
    }
  }
}

TEST(CudaFactoredMoment, TheTensorOpsStepOnCudaAgreesWithTheFusedCpuStep) {
  // Both passes of the factored step in tensor operations on the GPU, against the CPU's
  // fused update, with and without a first moment; then on bfloat16 weights, whose
  // rounding draws CUDA's bits (the weights then differ as independent roundings do).
  FRUGAL_SKIP_WITHOUT_CUDA();
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    for (const double beta1 : {0.9, 0.0}) {
      torch::manual_seed(12);
      std::vector<torch::Tensor> cpu{torch::randn({150, 60}).to(dtype).requires_grad_()};
      std::vector<torch::Tensor> cuda{cpu[0].detach().to(torch::kCUDA).requires_grad_()};
      const auto cpu_start = cpu[0].detach().to(torch::kFloat32);
      const auto options = to::AdamWOptions(1e-2).betas({beta1, 0.999}).weight_decay(0.01);
      fo::AdamW8bit a(cpu, options, kFactored, frugal::testing::optim8bit::kChunks);
      fo::AdamW8bit b(cuda, options, kFactored, frugal::testing::optim8bit::kChunks);
      for (int step = 0; step < 20; ++step) {
        cpu[0].mutable_grad() = (torch::randn({150, 60}) * (1 + step % 3)).to(dtype);
        cuda[0].mutable_grad() = cpu[0].grad().to(torch::kCUDA);
        a.step();
        b.step();
      }
      ASSERT_TRUE(state_of(b, cuda[0]).factored());
      const auto here = cuda[0].detach().cpu().to(torch::kFloat32);
      const auto there = cpu[0].detach().to(torch::kFloat32);
      if (dtype == torch::kFloat32) {
        const auto diff = (there - here).abs() / there.abs().max();
        if (beta1 == 0.0) {  // no codes: the two steps differ by float32 rounding only
          EXPECT_LE(diff.max().item<double>(), 1e-5);
        } else {
          // The first moment is kept in 8-bit codes: where a fused multiply-add rounds a
          // moment to the neighbouring code on one side, that weight's later updates differ
          // by a code's step (about 1e-4 of the largest weight). Such flips are rare: at most
          // 1 % of the weights beyond float32 rounding, and none further apart than both
          // sides' whole movement (each step moves a weight by at most about lr).
          const double flipped = (diff > 1e-5).to(torch::kFloat64).mean().item<double>();
          EXPECT_LE(flipped, 0.01);
          EXPECT_LE((there - here).abs().max().item<double>(), 2 * 20 * 1e-2);
        }
      } else {
        expect_independent_roundings(cpu_start, there, here, 20);
      }
      EXPECT_TRUE(torch::allclose(state_of(a, cpu[0]).exp_avg_sq_row(),
                                  state_of(b, cuda[0]).exp_avg_sq_row().cpu(), 1e-5, 0))
          << "beta1 " << beta1 << ", " << dtype;
    }
  }
}

}  // namespace
