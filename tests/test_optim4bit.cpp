// 4-bit optimizer states (Adam4bit, AdamW4bit, QuantizedStateOptions::bits 4): one step from
// the same state is float32 Adam's, the fused CPU step agrees with the tensor-ops one, the
// ledger counts the format's bytes, the step allocates no whole-parameter temporary, states
// save and load bit for bit and a file of the other width is refused, bad options are named.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <sstream>

#include "compat.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "helpers.h"
#include "optim8bit_setup.h"

namespace {

using namespace frugal::testing::optim8bit;

TEST(Optim4bit, OneStepFromTheSameStateIsFloat32AdamsStep) {
  // As Optim8bit's test: the arithmetic is Adam's, and each new state is its float32 value
  // rounded to one of the two codes around it of the 16 of its block's scale (stochastic
  // codes, four_bit_states()' default), or to the nearest one.
  expect_one_step_is_adams(fo::four_bit_states().min_elements(0), "[ 4-bit    ]");
  expect_one_step_is_adams(fo::four_bit_states().min_elements(0).stochastic_codes(false),
                           "[ 4-bit, nearest codes ]");
}

// 4-bit Adam's second moment against the exact moving average of the same gradients (drawn
// at random, the update plays no part): 2000 steps of gradients of one scale, then `steps`
// in which half of each block's elements get gradients a tenth as large. The mean of the
// second moment of those elements, over its exact value.
double fading_moment_mean(bool stochastic, int steps) {
  torch::manual_seed(11);
  auto p = torch::zeros({32, 128}, torch::requires_grad());
  fo::Adam4bit adam({p}, to::AdamOptions(1e-3),
                    fo::four_bit_states().min_elements(0).stochastic_codes(stochastic));
  const auto fading = torch::arange(32 * 128).remainder(2).eq(1);
  auto v = torch::zeros({32 * 128}, torch::kDouble);
  for (int k = 0; k < 2000 + steps; ++k) {
    auto g = torch::randn({32 * 128});
    if (k >= 2000) {
      g = torch::where(fading, g * 0.1, g);
    }
    p.mutable_grad() = g.view({32, 128}).clone();
    adam.step();
    v = 0.999 * v + 0.001 * g.to(torch::kDouble).square();
  }
  const auto v4 = moment_values(state_of(adam, p), false, p).view(-1).to(torch::kDouble);
  return (v4.masked_select(fading).mean() / v.masked_select(fading).mean()).item<double>();
}

TEST(Optim4bit, StochasticCodesFollowAFadingSecondMomentThatNearestCodesHoldBack) {
  // A step moves the second moment by a thousandth, less than half the gap between two of
  // 16 codes: rounded to the nearest code, a moment that should fade mostly stays.
  const double nearest = fading_moment_mean(false, 300);
  const double stochastic = fading_moment_mean(true, 300);
  std::cout << "[ 4-bit    ] 300 steps after the gradients of half the elements fell tenfold, "
               "their second moment's mean over the exact one: "
            << nearest << " with nearest codes, " << stochastic << " with stochastic ones\n";
  EXPECT_NEAR(stochastic, 1.0, 0.03);
  EXPECT_GT(nearest, 1.1);
}

// The second-moment map's lowest value is a 32nd of the next (1e-4): a moment 4e-4 of its
// block's largest (gradients a fiftieth of one large element's) is stored within a fifth of
// its value over 4000 steps (what stays is the steps that land below 1e-4), where a lowest
// value of half the next (0.0016) held it up fourfold.
TEST(Optim4bit, SmallSecondMomentsAreNotHeldUpToTheLowestCode) {
  torch::manual_seed(12);
  auto p = torch::zeros({32, 128}, torch::requires_grad());
  fo::Adam4bit adam({p}, to::AdamOptions(1e-3), fo::four_bit_states().min_elements(0));
  const auto small = torch::arange(32 * 128).remainder(128).ne(0);  // all but one a block
  const auto scale = torch::where(small, torch::full({1}, 0.2), torch::full({1}, 10.0));
  auto v = torch::zeros({32 * 128}, torch::kDouble);
  for (int k = 0; k < 4000; ++k) {
    const auto g = torch::randn({32 * 128}) * scale;
    p.mutable_grad() = g.view({32, 128}).clone();
    adam.step();
    v = 0.999 * v + 0.001 * g.to(torch::kDouble).square();
  }
  const auto v4 = moment_values(state_of(adam, p), false, p).view(-1).to(torch::kDouble);
  const double ratio =
      (v4.masked_select(small).mean() / v.masked_select(small).mean()).item<double>();
  const double share =
      (v.masked_select(small).mean() / v.masked_select(~small).mean()).item<double>();
  std::cout << "[ 4-bit    ] second moments at " << share
            << " of their block's largest: stored over exact " << ratio << "\n";
  EXPECT_LT(share, 0.0016 / 2);  // below the old lowest value
  EXPECT_NEAR(ratio, 1.0, 0.2);
}

TEST(Optim4bit, TheFusedCpuStepAgreesWithTheTensorOpsStep) {
  for (const bool factored : {false, true}) {
    const auto agree = fused_against_tensor_ops(fo::four_bit_states().factored(factored));
    std::cout << "[ 4-bit    ] fused vs tensor ops after 20 steps" << (factored ? ", factored" : "")
              << ": parameters " << agree.weights << " apart (of the largest), "
              << agree.codes_differing << " of " << agree.codes << " first-moment codes differ\n";
    EXPECT_LE(agree.weights, 1e-5) << "factored " << factored;
    EXPECT_LE(agree.codes_apart, 1) << "factored " << factored;
    EXPECT_LE(agree.codes_differing, agree.codes / 100) << "factored " << factored;
  }
}

// Bytes of 4-bit Adam's states: codes (half a byte an element, rounded up a parameter) and
// scales (4 bytes a block of 128) for each moment of parameters of 4096 elements or more, a
// factored matrix's rows and columns instead of its second moment's codes, float32 moments
// for the others, and the two 16-value code books (31 float32 each).
std::int64_t four_bit_bytes(const std::vector<torch::Tensor>& params, bool factored) {
  std::int64_t bytes = 2 * 31 * 4;
  for (const auto& p : params) {
    const auto n = p.numel();
    const auto codes = (n + 1) / 2 + 4 * ((n + 127) / 128);
    const bool matrix = factored && p.dim() == 2 && 4 * (p.size(0) + p.size(1)) < n;
    bytes += n < 4096 ? 8 * n : codes + (matrix ? 4 * (p.size(0) + p.size(1)) : codes);
  }
  return bytes;
}

TEST(Optim4bit, ABlocksLargestNegativeFirstMomentIsKeptAsItsLargestPositiveIs) {
  // Each block of 128 has its largest gradient twice: -1 at element 0 and +1 at element 1.
  // Their first moments are each step the block's scale, so both are exact, mirrored:
  // (1 - beta1^t) of the gradient, where a map that reaches 1 but not -1 shrinks the
  // negative one at every step.
  torch::manual_seed(31);
  auto g = torch::rand({32, 128}) * 0.5 - 0.25;
  g.select(1, 0).fill_(-1.0);
  g.select(1, 1).fill_(1.0);
  for (const bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused CPU step" : "tensor-ops step (a strided parameter)");
    auto p = fused ? torch::zeros({32, 128}) : torch::zeros({128, 32}).t();
    ASSERT_EQ(p.is_contiguous(), fused);
    fo::Adam4bit adam({p}, to::AdamOptions(1e-3));
    for (int t = 1; t <= 8; ++t) {
      p.mutable_grad() = g.clone();
      adam.step();
      const auto m = moment_values(state_of(adam, p), true, p);
      const double expected = 1.0 - std::pow(0.9, t);
      EXPECT_NEAR(m.select(1, 0).min().item<double>(), -expected, 1e-6 * expected) << t;
      EXPECT_NEAR(m.select(1, 0).max().item<double>(), -expected, 1e-6 * expected) << t;
      EXPECT_TRUE(torch::equal(m.select(1, 0), -m.select(1, 1))) << t;
    }
  }
  // The map itself: -1 and 1 at its ends.
  const auto map = fo::moment_map(true, 4);
  EXPECT_EQ(map.min().item<float>(), -1.0F);
  EXPECT_EQ(map.max().item<float>(), 1.0F);
}

TEST(Optim4bit, TheLedgerCountsTheFormatsBytes) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  for (const bool factored : {false, true}) {
    auto params = make_8bit_params();
    params[1] = torch::randn({9001}).requires_grad_();  // an odd count: a half-used last byte
    ParamsModule holder(params);
    fo::AdamW4bit adam(params, to::AdamWOptions(1e-3), fo::four_bit_states().factored(factored));
    const auto expected = four_bit_bytes(params, factored);
    EXPECT_EQ(adam.pending_state_bytes(adam.state_format()), expected) << "factored " << factored;
    set_growing_grads(params, 0);
    const auto before = probe.allocated();
    adam.step();
    EXPECT_EQ(probe.allocated() - before, expected) << "factored " << factored;
    EXPECT_EQ(frugal::measure_ledger(probe, holder, &adam).optimizer, expected);
    EXPECT_THROW(adam.set_state_format({8, factored, true}), c10::Error);
    std::int64_t numel = 0;
    for (const auto& p : params) {
      numel += p.numel();
    }
    std::cout << "[ 4-bit    ] states of " << numel << " parameters"
              << (factored ? ", factored" : "") << ": " << expected << " B ("
              << static_cast<double>(expected) / numel << " B a parameter)\n";
  }
}

TEST(Optim4bit, TheStepAllocatesNoWholeParameterTemporaries) {
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  torch::manual_seed(3);
  const std::int64_t big = 1 << 20;
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    std::vector<torch::Tensor> fused{torch::randn({big}).to(dtype).requires_grad_()};
    fo::Adam4bit a(fused, to::AdamOptions(1e-3).weight_decay(1e-2));
    // The float32 weights' chunk the base lends bfloat16 updates (unused by the fused loop),
    // and LibTorch's few-byte wrappers; a float32 copy of the parameter would be 4 MiB.
    const auto lent = dtype == torch::kFloat32 ? 0 : a.in_place_options().chunk() * 4;
    const auto overhead = step_overhead(a, fused, probe);
    std::cout << "[ 4-bit    ] step of a 1 M-element " << dtype << " parameter: " << overhead
              << " B above its start\n";
    EXPECT_LE(overhead, lent + 256);
    EXPECT_LT(overhead, big * 2);
  }
}

TEST(Optim4bit, StateRoundTripsThroughTorchSaveAndResumesBitForBit) {
  auto a = make_8bit_params();
  const auto options = to::AdamWOptions(1e-2).weight_decay(0.01);
  fo::AdamW4bit ours(a, options, fo::four_bit_states(), kChunks);
  step_together(0, 3, {&a}, ours);
  std::stringstream file;
  torch::save(ours, file);
  auto b = clone_params(a);
  fo::AdamW4bit loaded(b, options, fo::four_bit_states(), kChunks);
  torch::load(loaded, file);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(state_of(loaded, b[i]).bits(), state_of(ours, a[i]).quantized() ? 4 : 8);
    EXPECT_TRUE(torch::equal(state_of(loaded, b[i]).exp_avg(), state_of(ours, a[i]).exp_avg()));
  }
  step_together(3, 8, {&a, &b}, ours, loaded);
  EXPECT_EQ(max_abs_diff(a, b), 0);

  // The other width is refused, naming it, and changes nothing.
  auto c = clone_params(a);
  fo::AdamW8bit eight(c, options, fo::QuantizedStateOptions().block(128), kChunks);
  set_growing_grads(c, 0);
  eight.step();
  const auto codes = state_of(eight, c[0]).exp_avg().clone();
  file.seekg(0);
  expect_error_contains([&] { torch::load(eight, file); },
                        "holds 4-bit codes but this optimizer's are 8-bit");
  EXPECT_TRUE(torch::equal(state_of(eight, c[0]).exp_avg(), codes));
}

// A state keeps the layout it was made in: a factored save goes on factored in an optimizer
// built without `factored` (and the other way round), exactly as the run that saved it.
TEST(Optim4bit, ALoadedStateKeepsItsLayoutAndGoesOnAsTheRunThatSavedIt) {
  for (const bool saved_factored : {true, false}) {
    SCOPED_TRACE(saved_factored ? "factored save, whole optimizer" : "whole save, factored one");
    auto a = make_8bit_params();
    const auto options = to::AdamOptions(1e-2);
    fo::Adam4bit saved(a, options, fo::four_bit_states().min_elements(0).factored(saved_factored),
                       kChunks);
    step_together(0, 3, {&a}, saved);
    std::stringstream file;
    torch::save(saved, file);
    auto b = clone_params(a);
    fo::Adam4bit loaded(b, options, fo::four_bit_states().min_elements(0).factored(!saved_factored),
                        kChunks);
    torch::load(loaded, file);
    bool some_factored = false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(state_of(loaded, b[i]).factored(), state_of(saved, a[i]).factored()) << i;
      some_factored = some_factored || state_of(saved, a[i]).factored();
    }
    EXPECT_EQ(some_factored, saved_factored);
    step_together(3, 8, {&a, &b}, saved, loaded);
    EXPECT_EQ(max_abs_diff(a, b), 0);
  }
}

TEST(Optim4bit, BadOptionsNameTheValue) {
  auto params = make_8bit_params();
  expect_error_contains(
      [&] { fo::Adam8bit(params, to::AdamOptions(1e-3), fo::QuantizedStateOptions().bits(3)); },
      "bits must be 8 or 4, got 3");
  expect_error_contains(
      [&] { fo::Adam4bit(params, to::AdamOptions(1e-3), fo::four_bit_states().block(129)); },
      "need an even QuantizedStateOptions block, got 129");
  fo::Adam8bit adam(params, to::AdamOptions(1e-3), fo::QuantizedStateOptions().block(255));
  expect_error_contains([&] { adam.set_state_format({4}); }, "got 255");
  EXPECT_EQ(adam.state_format().bits, 8);
  // Adam4bit is 4-bit whatever the options say.
  EXPECT_EQ(
      fo::Adam4bit(params, to::AdamOptions(1e-3), fo::QuantizedStateOptions()).state_format().bits,
      4);
}

TEST(Optim4bit, TrainsALeastSquaresProblemAsAdamDoes) {
  // A linear model fitted to noisy targets: 4-bit AdamW, plain and factored, reaches a loss
  // near float32 AdamW's, all far below the start. (The 4-bit first moment converges later
  // than float32's on this full-batch problem: its 16 codes round the last small changes of
  // a moment away; after 300 steps its loss is still several times AdamW's.)
  const auto options = to::AdamWOptions(3e-2);
  const auto fit = [&](auto make) { return least_squares(make, 128, 1000); };
  const auto adamw = fit([&](auto& w) { return std::make_unique<fo::AdamW>(w, options); });
  const float four = fit([&](auto& w) { return std::make_unique<fo::AdamW4bit>(w, options); }).loss;
  const float factored =
      fit([&](auto& w) {
        return std::make_unique<fo::AdamW4bit>(w, options, fo::four_bit_states().factored(true));
      }).loss;
  std::cout << "[ 4-bit    ] least squares after 1000 steps: start " << adamw.start << ", AdamW "
            << adamw.loss << ", AdamW4bit " << four << ", factored " << factored << "\n";
  EXPECT_LE(adamw.loss, adamw.start / 50);
  EXPECT_LE(four, 1.5 * adamw.loss);
  EXPECT_LE(factored, 1.5 * adamw.loss);
}

}  // namespace

namespace {

TEST(CudaOptim4bit, TheTensorOpsStepOnCudaAgreesWithTheFusedCpuStep) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  // Nearest codes: stochastic ones draw their bits from CUDA's generator there, other bits
  // than the CPU's hash.
  const auto agree = cuda_against_fused_cpu(fo::four_bit_states().stochastic_codes(false));
  expect_cuda_agrees(agree);
}

}  // namespace
