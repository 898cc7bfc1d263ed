// bfloat16 weights: each optimizer's update computed in float32 and written back rounded to
// nearest, stochastically, or with a compensation buffer (frugal::optim::Rounding).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/optim/sgd.h"
#include "helpers.h"

namespace {

namespace to = torch::optim;
namespace fo = frugal::optim;
using RoundingFactory =
    std::function<std::unique_ptr<to::Optimizer>(std::vector<torch::Tensor>, fo::InPlaceOptions)>;

struct RoundingCase {
  std::string name;
  RoundingFactory make;
  // The state is kept in the parameter's dtype (bfloat16 moments, rounded to nearest, as
  // LibTorch keeps them), not computed in float32 as 8-bit states are.
  bool bf16_state = false;
};
void PrintTo(const RoundingCase& c, std::ostream* out) { *out << c.name; }

// Every optimizer here moves a weight in [0.5, 1) by about 1e-3 a step (at most 1.5e-3):
// under half of bfloat16's gap there (2^-8), so rounding to nearest loses every update.
std::vector<RoundingCase> rounding_cases() {
  return {
      {"SGD", [](auto p, auto o) { return std::make_unique<fo::SGD>(p, to::SGDOptions(1e-3), o); }},
      {"SGDMomentum",
       [](auto p, auto o) {
         return std::make_unique<fo::SGD>(p, to::SGDOptions(1e-4).momentum(0.9), o);
       },
       true},
      {"Adam",
       [](auto p, auto o) { return std::make_unique<fo::Adam>(p, to::AdamOptions(1e-3), o); },
       true},
      {"AdamW",
       [](auto p, auto o) {
         return std::make_unique<fo::AdamW>(p, to::AdamWOptions(1e-3).weight_decay(0.01), o);
       },
       true},
      {"Adam8bit",
       [](auto p, auto o) {
         return std::make_unique<fo::Adam8bit>(p, to::AdamOptions(1e-3),
                                               fo::QuantizedStateOptions().min_elements(1), o);
       }},
      {"AdamW8bit",
       [](auto p, auto o) {
         return std::make_unique<fo::AdamW8bit>(p, to::AdamWOptions(1e-3),
                                                fo::QuantizedStateOptions().min_elements(1), o);
       }},
  };
}

constexpr std::int64_t kRoundedElements = 8192;
constexpr int kRoundedSteps = 40;
const double kBf16Gap = std::ldexp(1.0, -8);  // between bfloat16 values in [0.5, 1)

// Weights in [0.6, 1) that bfloat16 holds exactly (40 steps keep them above 0.5, where the
// gap halves), and a gradient in [0.5, 1.5) each.
struct RoundingProblem {
  RoundingProblem() {
    auto generator = torch::make_generator<torch::CPUGeneratorImpl>(3);
    start = (0.6 + 0.399 * torch::rand({kRoundedElements}, generator)).to(torch::kBFloat16);
    grad = (0.5 + torch::rand({kRoundedElements}, generator)).to(torch::kBFloat16);
  }
  torch::Tensor start, grad;
};

// `steps` steps of the optimizer `make` builds on a copy of the start in `dtype` on
// `device`; the weights after them, on the CPU.
torch::Tensor train_rounded(const RoundingCase& c, const RoundingProblem& rp,
                            torch::ScalarType dtype, fo::InPlaceOptions options,
                            int steps = kRoundedSteps,
                            std::vector<torch::Tensor>* state = nullptr,
                            torch::Device device = torch::kCPU) {
  auto p = rp.start.to(device, dtype).clone().requires_grad_();
  auto optimizer = c.make({p}, options);
  for (int i = 0; i < steps; ++i) {
    p.mutable_grad() = rp.grad.to(device, dtype).clone();
    optimizer->step();
  }
  if (state != nullptr) {
    *state = dynamic_cast<fo::InPlaceOptimizer&>(*optimizer).ledger_optimizer_state();
  }
  return p.detach().cpu();
}

class LowPrecisionWeights : public ::testing::TestWithParam<RoundingCase> {};

TEST_P(LowPrecisionWeights, RoundingToNearestLosesEveryUpdate) {
  const RoundingProblem rp;
  const auto reference = train_rounded(GetParam(), rp, torch::kFloat32, {});
  const auto nearest = train_rounded(GetParam(), rp, torch::kBFloat16,
                                     fo::InPlaceOptions().rounding(fo::Rounding::Nearest));
  const double moved = (rp.start.to(torch::kFloat32) - reference).mean().item<double>();
  EXPECT_GT(moved, kRoundedSteps * 0.4e-3) << "the float32 run should move each weight";
  EXPECT_TRUE(torch::equal(nearest, rp.start)) << "every update was under half a gap";
}

// What a compensated run holds: weight plus compensation, the updates summed to 16 bits.
torch::Tensor compensated_sum(const RoundingCase& c, const RoundingProblem& rp,
                              torch::Tensor* weights = nullptr) {
  std::vector<torch::Tensor> state;
  const auto w = train_rounded(c, rp, torch::kBFloat16,
                               fo::InPlaceOptions().rounding(fo::Rounding::Compensated),
                               kRoundedSteps, &state);
  EXPECT_EQ(state.size(), 1U);
  EXPECT_EQ(state.at(0).scalar_type(), torch::kBFloat16);
  if (weights != nullptr) {
    *weights = w;
  }
  return w.to(torch::kFloat32) + state.at(0).to(torch::kFloat32);
}

// Each step loses at most the compensation's own rounding, 2^-9 of half a gap.
const double kCompensatedError = kRoundedSteps * kBf16Gap * std::ldexp(1.0, -10);

TEST_P(LowPrecisionWeights, StochasticRoundingKeepsTheMeanOfTheUpdates) {
  const RoundingProblem rp;
  // The same updates summed without loss (the compensated run: its states and updates
  // are those of this run, which the weights' rounding does not change).
  const auto exact = compensated_sum(GetParam(), rp);
  const auto rounded = train_rounded(GetParam(), rp, torch::kBFloat16, {});  // the default
  ASSERT_EQ(rounded.scalar_type(), torch::kBFloat16);
  // Each rounding errs by less than a gap, without bias: after kRoundedSteps steps an
  // element is off by a sum of that many such errors, their mean over kRoundedElements by
  // 6 standard deviations at most (a rounding's error has a deviation under gap / 2).
  const double tolerance = 6 * std::sqrt(kRoundedSteps) * (kBf16Gap / 2) /
                               std::sqrt(static_cast<double>(kRoundedElements)) +
                           kCompensatedError;
  const double mean_error = (rounded.to(torch::kFloat32) - exact).mean().item<double>();
  EXPECT_LT(std::abs(mean_error), tolerance);
  // Each element within 6 standard deviations of its sum of errors, and the run moved them,
  // unlike rounding to nearest.
  EXPECT_LE((rounded.to(torch::kFloat32) - exact).abs().max().item<double>(),
            6 * std::sqrt(kRoundedSteps) * (kBf16Gap / 2));
  const double moved = (rp.start.to(torch::kFloat32) - exact).mean().item<double>();
  EXPECT_GT(moved, kRoundedSteps * 0.4e-3);
  EXPECT_NEAR((rp.start - rounded).to(torch::kFloat32).mean().item<double>(), moved, tolerance);
}

TEST_P(LowPrecisionWeights, CompensationFollowsFloat32Weights) {
  const RoundingProblem rp;
  const auto reference = train_rounded(GetParam(), rp, torch::kFloat32, {});
  torch::Tensor weights;
  const auto held = compensated_sum(GetParam(), rp, &weights);
  const double error = (held - reference).abs().max().item<double>();
  const double moved = (rp.start.to(torch::kFloat32) - reference).abs().mean().item<double>();
  if (GetParam().bf16_state) {
    // The moments themselves are bfloat16 here, rounded to nearest: a moment whose change
    // is under half its gap stays, some percent off float32's. Still far from rounding the
    // weights to nearest, which loses all of `moved`.
    EXPECT_LT(error, moved / 10);
  } else {
    EXPECT_LE(error, kCompensatedError);
  }
  // The weight itself is the sum rounded to nearest: within half a gap of it.
  EXPECT_LE((weights.to(torch::kFloat32) - held).abs().max().item<double>(), kBf16Gap / 2);
}

TEST_P(LowPrecisionWeights, ResumesBitForBitFromASave) {
  const RoundingProblem rp;
  for (const auto rounding : {fo::Rounding::Stochastic, fo::Rounding::Compensated}) {
    const auto options = fo::InPlaceOptions().rounding(rounding).seed(7);
    const auto straight = train_rounded(GetParam(), rp, torch::kBFloat16, options, 20);

    auto p = rp.start.clone().requires_grad_();
    auto first = GetParam().make({p}, options);
    const auto run = [&](to::Optimizer& o, int steps) {
      for (int i = 0; i < steps; ++i) {
        p.mutable_grad() = rp.grad.clone();
        o.step();
      }
    };
    run(*first, 10);
    std::stringstream saved;
    {
      torch::serialize::OutputArchive archive;
      first->save(archive);
      archive.save_to(saved);
    }
    auto resumed = GetParam().make({p}, options);
    {
      torch::serialize::InputArchive archive;
      archive.load_from(saved);
      resumed->load(archive);
    }
    run(*resumed, 10);
    EXPECT_TRUE(torch::equal(p.detach(), straight)) << static_cast<int>(rounding);
  }
}

TEST_P(LowPrecisionWeights, TheSeedChoosesTheRandomBits) {
  const RoundingProblem rp;
  const auto a = train_rounded(GetParam(), rp, torch::kBFloat16, fo::InPlaceOptions().seed(1));
  const auto b = train_rounded(GetParam(), rp, torch::kBFloat16, fo::InPlaceOptions().seed(1));
  const auto c = train_rounded(GetParam(), rp, torch::kBFloat16, fo::InPlaceOptions().seed(2));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_FALSE(torch::equal(a, c));
}

INSTANTIATE_TEST_SUITE_P(Optimizers, LowPrecisionWeights, ::testing::ValuesIn(rounding_cases()),
                         [](const auto& info) { return info.param.name; });

class CudaLowPrecisionWeights : public ::testing::TestWithParam<RoundingCase> {};

TEST_P(CudaLowPrecisionWeights, StochasticRoundingKeepsTheMeanAndRepeatsItself) {
  // CUDA's tensor-operations step and its random bits (a generator of the device seeded
  // from the same key): the bound of the CPU's test, and the same seed twice gives the
  // same weights.
  FRUGAL_SKIP_WITHOUT_CUDA();
  const RoundingProblem rp;
  const auto exact = compensated_sum(GetParam(), rp);  // on the CPU: the same updates
  const auto options = fo::InPlaceOptions().seed(4);
  const auto rounded =
      train_rounded(GetParam(), rp, torch::kBFloat16, options, kRoundedSteps, nullptr, torch::kCUDA);
  const auto again =
      train_rounded(GetParam(), rp, torch::kBFloat16, options, kRoundedSteps, nullptr, torch::kCUDA);
  EXPECT_TRUE(torch::equal(rounded, again));
  const double tolerance = 6 * std::sqrt(kRoundedSteps) * (kBf16Gap / 2) /
                               std::sqrt(static_cast<double>(kRoundedElements)) +
                           kCompensatedError;
  EXPECT_LT(std::abs((rounded.to(torch::kFloat32) - exact).mean().item<double>()), tolerance);
  EXPECT_LE((rounded.to(torch::kFloat32) - exact).abs().max().item<double>(),
            6 * std::sqrt(kRoundedSteps) * (kBf16Gap / 2));
  EXPECT_FALSE(torch::equal(rounded, rp.start)) << "the updates should move the weights";
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaLowPrecisionWeights, ::testing::ValuesIn(rounding_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(LowPrecisionWeights, TheLedgerCountsTheCompensationExactly) {
  frugal::MemoryProbe probe(torch::kCPU);
  torch::manual_seed(0);
  torch::nn::Linear layer(256, 64);
  layer->to(torch::kBFloat16);
  std::vector<std::int64_t> optimizer_bytes, other_bytes;
  for (const auto rounding : {fo::Rounding::Stochastic, fo::Rounding::Compensated}) {
    fo::Adam adam(layer->parameters(), to::AdamOptions(1e-3),
                  fo::InPlaceOptions().rounding(rounding));
    layer->forward(torch::randn({4, 256}, torch::kBFloat16)).sum().backward();
    adam.step();
    const auto ledger = frugal::measure_ledger(probe, *layer, &adam);
    optimizer_bytes.push_back(ledger.optimizer);
    other_bytes.push_back(ledger.other);
    for (auto& p : layer->parameters()) {
      p.mutable_grad().reset();
    }
  }
  // Adam's two bfloat16 moments, then those and the bfloat16 compensation.
  const std::int64_t weights = 2 * (256 * 64 + 64);
  EXPECT_EQ(optimizer_bytes[0], 2 * weights);
  EXPECT_EQ(optimizer_bytes[1], 3 * weights);
  // The compensation's bytes are in the optimizer's part, not left in `other`.
  EXPECT_EQ(other_bytes[1], other_bytes[0]);
}

}  // namespace
