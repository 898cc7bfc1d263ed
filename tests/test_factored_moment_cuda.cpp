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
        const double diff = ((there - here).abs().max() / there.abs().max()).item<double>();
        EXPECT_LE(diff, 1e-5) << "beta1 " << beta1;
      } else {
        // Each step each side rounds up or down at random, unbiased, by less than a gap
        // (2^-7 of the weight's binade), drawing other bits (CUDA's, the CPU's hash): the two
        // runs' weights walk apart by independent roundings, the difference's variance at
        // most gap^2 / 2 a step. In gaps: the mean within 5 standard errors of 0, the root
        // mean square within sqrt(steps / 2) and a quarter.
        const auto gap =
            torch::pow(2.0, torch::floor(torch::log2(there.abs().clamp_min(1e-30))) - 7);
        const auto apart = (here - there) / gap;
        const double walk = std::sqrt(20 / 2.0);
        const double rms = apart.pow(2).mean().sqrt().item<double>();
        const double mean = apart.mean().item<double>();
        EXPECT_LE(rms, 1.25 * walk) << "beta1 " << beta1;
        EXPECT_LE(std::abs(mean), 5 * walk / std::sqrt(static_cast<double>(apart.numel())))
            << "beta1 " << beta1;
      }
      EXPECT_TRUE(torch::allclose(state_of(a, cpu[0]).exp_avg_sq_row(),
                                  state_of(b, cuda[0]).exp_avg_sq_row().cpu(), 1e-5, 0))
          << "beta1 " << beta1 << ", " << dtype;
    }
  }
}

}  // namespace
