// The fused CPU steps on bfloat16 weights: 8-bit states (Adam8bit, AdamW8bit, factored or
// not) and Adam's bfloat16 moments, each the float32 step on the widened values rounded once.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "helpers.h"
#include "optim/rounding.h"

namespace {

namespace to = torch::optim;
namespace fo = frugal::optim;

// One 8-bit step on bfloat16 weights, on the CPU, is the same step on float32 copies of the
// weights and gradient, rounded as the optimizer rounds: stochastically with the bits of
// update `update` (one parameter: one update a step), or to nearest.
void expect_rounded_float32_step(bool factored, fo::Rounding rounding) {
  const std::uint64_t seed = 5;
  // 3000 elements: blocks of 256 and a short last one; a matrix of 60 by 50 when factored.
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(8);
  auto low = torch::randn({60, 50}, generator).to(torch::kBFloat16).requires_grad_();
  auto wide = low.detach().to(torch::kFloat32).requires_grad_();
  const auto options = to::AdamWOptions(1e-2).weight_decay(0.1);
  const auto quantized = fo::QuantizedStateOptions().min_elements(1).factored(factored);
  fo::AdamW8bit low_adam({low}, options, quantized,
                         fo::InPlaceOptions().rounding(rounding).seed(seed).chunk(1000));
  fo::AdamW8bit wide_adam({wide}, options, quantized);
  for (std::uint64_t update = 0; update < 4; ++update) {
    low.mutable_grad() = torch::randn({60, 50}, generator).to(torch::kBFloat16);
    wide.mutable_grad() = low.grad().to(torch::kFloat32);
    {
      torch::NoGradGuard no_grad;
      wide.copy_(low);
    }
    low_adam.step();
    wide_adam.step();
    auto expected = wide.detach().clone();
    if (rounding == fo::Rounding::Stochastic) {
      frugal::optim::detail::round_stochastic_cpu(expected.data_ptr<float>(), expected.numel(),
                                                  frugal::optim::detail::rounding_key(seed, update),
                                                  0);
    }
    expected = expected.to(torch::kBFloat16);
    EXPECT_TRUE(torch::equal(low.detach(), expected))
        << "update " << update << ": " << (low.detach() != expected).sum().item<int64_t>()
        << " weights differ";
    // The moments come from the gradients alone (AdamW): the same codes.
    const auto& a = dynamic_cast<const fo::Adam8bitParamState&>(*low_adam.state().begin()->second);
    const auto& b = dynamic_cast<const fo::Adam8bitParamState&>(*wide_adam.state().begin()->second);
    EXPECT_TRUE(torch::equal(a.exp_avg(), b.exp_avg())) << "update " << update;
    if (factored) {
      EXPECT_TRUE(torch::equal(a.exp_avg_sq_row(), b.exp_avg_sq_row())) << "update " << update;
    } else {
      EXPECT_TRUE(torch::equal(a.exp_avg_sq(), b.exp_avg_sq())) << "update " << update;
    }
  }
  // The updates moved the weights (not a step that does nothing on both sides).
  EXPECT_GT((low.detach().to(torch::kFloat32) - wide.detach()).abs().max().item<double>(), 0)
      << "the last float32 step should land between bfloat16 values";
}

TEST(FusedBf16Step, EightBitStatesTakeTheFloat32StepRounded) {
  for (const bool factored : {false, true}) {
    for (const auto rounding : {fo::Rounding::Stochastic, fo::Rounding::Nearest}) {
      SCOPED_TRACE(std::string(factored ? "factored, " : "codes, ") +
                   (rounding == fo::Rounding::Stochastic ? "stochastic" : "nearest"));
      expect_rounded_float32_step(factored, rounding);
    }
  }
}

TEST(FusedBf16Step, EightBitStatesAgreeWithTheTensorOpsStep) {
  // The same values, contiguous (the fused loop) and transposed (tensor ops, the path of
  // other devices), index for index: the same random bits. The float32 results differ in
  // their last bits, so a weight may round to the other neighbour, rarely.
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(9);
  auto fused = torch::randn({150, 60}, generator).to(torch::kBFloat16).requires_grad_();
  auto strided = fused.detach().t().contiguous().t().requires_grad_();
  ASSERT_FALSE(strided.is_contiguous());
  const auto quantized = fo::QuantizedStateOptions().min_elements(1);
  fo::Adam8bit a({fused}, to::AdamOptions(1e-2).weight_decay(0.01), quantized);
  fo::Adam8bit b({strided}, to::AdamOptions(1e-2).weight_decay(0.01), quantized);
  for (int step = 0; step < 10; ++step) {
    fused.mutable_grad() = torch::randn({150, 60}, generator).to(torch::kBFloat16);
    strided.mutable_grad() = fused.grad().t().contiguous().t();
    a.step();
    b.step();
  }
  const auto x = fused.detach().to(torch::kFloat32), y = strided.detach().to(torch::kFloat32);
  const auto apart = (x - y).abs() / x.abs().clamp_min(1e-30);
  const auto differ = (x != y).sum().item<std::int64_t>();
  std::cout << "[ bf16     ] fused vs tensor ops after 10 steps: " << differ << " of " << x.numel()
            << " weights differ, at most " << apart.max().item<double>() << " apart\n";
  EXPECT_LE(differ, x.numel() / 100);
  // A weight on the other side: a bfloat16 gap apart, 2^-7 of it at most, a few times over
  // the steps.
  EXPECT_LE(apart.max().item<double>(), 4 * std::ldexp(1.0, -7));
}

TEST(FusedBf16Step, EightBitStatesAllocateNoWholeParameterTemporaries) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  const std::int64_t big = 1 << 20;  // elements
  std::vector<torch::Tensor> params{torch::randn({big}).to(torch::kBFloat16).requires_grad_()};
  fo::Adam8bit adam(params, to::AdamOptions(1e-3));
  const auto overhead = frugal::testing::step_overhead(adam, params, probe);
  // The scratch the step says it needs (among it the float32 weights' chunk the base lends
  // every bfloat16 update, which the fused loop does not use), and LibTorch's few-byte
  // wrappers; a float32 copy of the parameter would be 4 MiB.
  std::cout << "[ bf16     ] Adam8bit step on 2^20 bfloat16 weights allocates " << overhead
            << " B above its start\n";
  EXPECT_GE(overhead, adam.scratch_bytes());
  EXPECT_LE(overhead, adam.scratch_bytes() + 64);
  EXPECT_LT(overhead, big * 2);
}

// Adam's step, in float32 tensor operations (LibTorch's order), on bfloat16 weights,
// gradient and moments widened: the weights after it rounded as `rounding` says with the
// bits of update `update`, and the moments rounded to nearest.
struct WidenedAdam {
  torch::Tensor p, m, v;
};
WidenedAdam widened_adam_step(const torch::Tensor& p16, const torch::Tensor& g16,
                              const torch::Tensor& m16, const torch::Tensor& v16, bool fresh,
                              bool decoupled, double lr, double decay, std::int64_t step,
                              fo::Rounding rounding, std::uint64_t seed, std::uint64_t update) {
  const double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  auto p = p16.to(torch::kFloat32), g = g16.to(torch::kFloat32);
  auto m = fresh ? torch::zeros_like(p) : m16.to(torch::kFloat32);
  auto v = fresh ? torch::zeros_like(p) : v16.to(torch::kFloat32);
  // Each product and sum rounded on its own (LibTorch's vectorized add with a factor and
  // addcdiv may fuse them).
  if (decoupled) {
    p.mul_(1 - lr * decay);
  } else {
    g = g + p * decay;
  }
  m.mul_(beta1).add_(g * (1 - beta1));
  v.mul_(beta2).add_(g * (1 - beta2) * g);
  const auto denom =
      v.sqrt().div_(std::sqrt(1 - std::pow(beta2, static_cast<double>(step)))).add_(eps);
  p.add_(m.div(denom).mul_(-lr / (1 - std::pow(beta1, static_cast<double>(step)))));
  if (rounding == fo::Rounding::Stochastic) {
    frugal::optim::detail::round_stochastic_cpu(
        p.data_ptr<float>(), p.numel(), frugal::optim::detail::rounding_key(seed, update), 0);
  }
  return {p.to(torch::kBFloat16), m.to(torch::kBFloat16), v.to(torch::kBFloat16)};
}

template <typename Optimizer, typename Options, typename State>
void expect_fused_bf16_adam(bool decoupled, fo::Rounding rounding) {
  const std::uint64_t seed = 3;
  const double lr = 1e-2, decay = 0.1;
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(6);
  // 5000 elements: two blocks of the fused loop and a short third.
  auto p = torch::randn({50, 100}, generator).to(torch::kBFloat16).requires_grad_();
  Optimizer adam({p}, Options(lr).weight_decay(decay),
                 fo::InPlaceOptions().rounding(rounding).seed(seed));
  torch::Tensor m, v;
  for (std::int64_t step = 1; step <= 4; ++step) {
    p.mutable_grad() = torch::randn({50, 100}, generator).to(torch::kBFloat16);
    const auto expected =
        widened_adam_step(p.detach(), p.grad(), m, v, step == 1, decoupled, lr, decay, step,
                          rounding, seed, static_cast<std::uint64_t>(step - 1));
    adam.step();
    const auto& state = dynamic_cast<const State&>(*adam.state().begin()->second);
    m = state.exp_avg();
    v = state.exp_avg_sq();
    EXPECT_TRUE(torch::equal(p.detach(), expected.p))
        << "step " << step << ": " << (p.detach() != expected.p).sum().item<int64_t>()
        << " weights differ";
    EXPECT_TRUE(torch::equal(m, expected.m)) << "step " << step;
    EXPECT_TRUE(torch::equal(v, expected.v)) << "step " << step;
  }
}

TEST(FusedBf16Step, AdamOnBf16MomentsRoundsOnceAStep) {
  // The CPU's fused pass: each step the float32 step on the widened values, rounded once.
  for (const auto rounding : {fo::Rounding::Stochastic, fo::Rounding::Nearest}) {
    SCOPED_TRACE(rounding == fo::Rounding::Stochastic ? "stochastic" : "nearest");
    expect_fused_bf16_adam<fo::Adam, to::AdamOptions, to::AdamParamState>(false, rounding);
    expect_fused_bf16_adam<fo::AdamW, to::AdamWOptions, to::AdamWParamState>(true, rounding);
  }
  // And it allocates no whole-parameter temporaries: the base's chunks only.
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  const std::int64_t big = 1 << 20;
  std::vector<torch::Tensor> params{torch::randn({big}).to(torch::kBFloat16).requires_grad_()};
  fo::AdamW adamw(params, to::AdamWOptions(1e-3));
  const auto overhead = frugal::testing::step_overhead(adamw, params, probe);
  EXPECT_GE(overhead, adamw.scratch_bytes());  // the float32 weights' chunk counted too
  EXPECT_LE(overhead, adamw.scratch_bytes() + 64);
  EXPECT_LT(overhead, big * 2);
}

}  // namespace
