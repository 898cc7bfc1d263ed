// Stochastic rounding of float32 values to bfloat16 and the bit conversions around it, as
// the bf16 weights' updates use them (src/optim/rounding.h): the draws' proportions, their
// independence of how the elements are split, and special values.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/probe.h"
#include "optim/rounding.h"

namespace {

TEST(StochasticRounding, RoundsToEitherNeighbourInProportion) {
  // 2^16 copies of 1 + f gaps (bfloat16's gap at 1 is 2^-7), for f = 0.1, 0.5, 0.9, and
  // their negatives.
  const double gap = std::ldexp(1.0, -7);
  for (const double f : {0.1, 0.5, 0.9, -0.1, -0.5, -0.9}) {
    const double x = (f < 0 ? -1 : 1) * (1 + std::abs(f) * gap);
    auto values = torch::full({1 << 16}, x, torch::kFloat32);
    frugal::optim::detail::round_stochastic_cpu(values.data_ptr<float>(), values.numel(), 42, 0);
    const auto magnitude = values.abs().to(torch::kDouble);
    const auto up = (magnitude == 1 + gap).to(torch::kDouble).mean().item<double>();
    const auto down = (magnitude == 1).to(torch::kDouble).mean().item<double>();
    EXPECT_DOUBLE_EQ(up + down, 1.0) << f;  // nothing but the two neighbours
    // A fraction of 2^16 draws: within 6 standard deviations of the probability.
    const double p = std::abs(f);
    EXPECT_NEAR(up, p, 6 * std::sqrt(p * (1 - p) / (1 << 16))) << f;
    EXPECT_NEAR(values.to(torch::kDouble).mean().item<double>(), x, 6 * gap / 256) << f;
  }
}

TEST(StochasticRounding, ChunksDrawTheBitsTheWholeWouldAndSpecialValuesStay) {
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(5);
  auto whole = torch::randn({10000}, generator);
  whole[17] = std::numeric_limits<float>::infinity();
  whole[18] = -std::numeric_limits<float>::infinity();
  whole[19] = std::numeric_limits<float>::quiet_NaN();
  auto parts = whole.clone();
  frugal::optim::detail::round_stochastic_cpu(whole.data_ptr<float>(), 10000, 9, 0);
  frugal::optim::detail::round_stochastic_cpu(parts.data_ptr<float>(), 3000, 9, 0);
  frugal::optim::detail::round_stochastic_cpu(parts.data_ptr<float>() + 3000, 7000, 9, 3000);
  EXPECT_TRUE(torch::equal(whole.narrow(0, 0, 19), parts.narrow(0, 0, 19)));
  EXPECT_TRUE(torch::equal(whole.narrow(0, 20, 9980), parts.narrow(0, 20, 9980)));
  EXPECT_TRUE(std::isinf(whole[17].item<float>()) && whole[17].item<float>() > 0);
  EXPECT_TRUE(std::isinf(whole[18].item<float>()) && whole[18].item<float>() < 0);
  EXPECT_TRUE(std::isnan(whole[19].item<float>()));
  // Every finite result is a bfloat16 value.
  const auto finite = whole.narrow(0, 20, 9980);
  EXPECT_TRUE(torch::equal(finite, finite.to(torch::kBFloat16).to(torch::kFloat32)));
}

TEST(StochasticRounding, TheTensorOpsPathKeepsEveryNanANanAndInfinitiesInfinite) {
  // The path CUDA takes, run on CPU tensors: NaNs of every payload and sign (CUDA's
  // canonical one is 0x7FFFFFFF), infinities, the largest finite value and ordinary ones.
  const std::vector<std::uint32_t> patterns = {0x7FFFFFFFU, 0xFFFFFFFFU, 0x7F800001U, 0xFFC00000U,
                                               0x7FC00000U, 0x7F800000U, 0xFF800000U, 0x7F7FFFFFU,
                                               0x3F800000U, 0xBF812345U};
  auto x = torch::empty({1 << 12}, torch::kFloat32);
  auto* data = reinterpret_cast<std::uint32_t*>(x.data_ptr<float>());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    data[i] = patterns[static_cast<std::size_t>(i) % patterns.size()];
  }
  const auto before = x.clone();
  auto bits = torch::empty({x.numel()}, torch::kInt32);
  {
    // An optimizer's update runs it: it allocates nothing (no mask of the NaNs).
    frugal::CountingAllocator::install();
    frugal::MemoryProbe probe(torch::kCPU);
    frugal::ScopedPeak peak(probe);
    const auto base = probe.allocated();
    frugal::optim::detail::round_stochastic_ops(x, bits, 21, 0);
    EXPECT_LE(peak.end() - base, 64) << "bytes allocated for " << x.numel() << " elements";
  }
  const auto was_nan = torch::isnan(before);
  EXPECT_TRUE(torch::equal(torch::isnan(x), was_nan));
  // Each NaN is bfloat16's quiet NaN, its bits exactly.
  EXPECT_TRUE(
      torch::equal(x.view(torch::kInt32).masked_select(was_nan),
                   torch::full({was_nan.sum().item<std::int64_t>()}, 0x7FC00000, torch::kInt32)));
  const auto infinite = torch::isinf(before);
  EXPECT_TRUE(torch::equal(x.masked_select(infinite), before.masked_select(infinite)));
  // The finite values land on bfloat16 values next to them (the largest may round to
  // infinity, as on the CPU).
  const auto finite = torch::isfinite(before);
  const auto rounded = x.masked_select(finite & torch::isfinite(x));
  EXPECT_TRUE(torch::equal(rounded, rounded.to(torch::kBFloat16).to(torch::kFloat32)));
  EXPECT_LE((x - before)
                .masked_select(finite & torch::isfinite(x))
                .abs()
                .div(before.masked_select(finite & torch::isfinite(x)).abs())
                .max()
                .item<float>(),
            std::ldexp(1.0F, -7));
}

TEST(StochasticRounding, NeighboursDrawTheirBitsIndependentlyWhereverAPieceStarts) {
  // Elements 2j and 2j + 1 take the two halves of one hash: a value halfway between two
  // bfloat16 values rounds up in half of the draws, and both of a pair in a quarter.
  const double gap = std::ldexp(1.0, -7);
  const std::int64_t n = 1 << 16;
  auto whole = torch::full({n}, 1 + 0.5 * gap, torch::kFloat32);
  auto pieces = whole.clone();
  frugal::optim::detail::round_stochastic_cpu(whole.data_ptr<float>(), n, 77, 0);
  const auto up = (whole == static_cast<float>(1 + gap)).to(torch::kDouble);
  const auto pairs = up.view({n / 2, 2});
  const double both = (pairs.select(1, 0) * pairs.select(1, 1)).mean().item<double>();
  // Elements 2j + 1 and 2j + 2: the high half of one hash and the low half of the next.
  const double across =
      (pairs.select(1, 1).narrow(0, 0, n / 2 - 1) * pairs.select(1, 0).narrow(0, 1, n / 2 - 1))
          .mean()
          .item<double>();
  const double sd = std::sqrt(0.25 * 0.75 / static_cast<double>(n / 2));  // of a share of pairs
  EXPECT_NEAR(up.mean().item<double>(), 0.5, 6 * std::sqrt(0.25 / n));
  EXPECT_NEAR(both, 0.25, 6 * sd);    // within a hash
  EXPECT_NEAR(across, 0.25, 6 * sd);  // between two hashes
  // Pieces that start at odd places and span several of the kernel's chunks draw the bits
  // the whole did.
  float* data = pieces.data_ptr<float>();
  const std::int64_t cuts[] = {0, 1, 700, 701, 1999, n};
  for (std::size_t i = 0; i + 1 < sizeof(cuts) / sizeof(cuts[0]); ++i) {
    frugal::optim::detail::round_stochastic_cpu(data + cuts[i], cuts[i + 1] - cuts[i], 77, cuts[i]);
  }
  EXPECT_TRUE(torch::equal(whole, pieces));
}

TEST(StochasticRounding, OnePassNarrowingGivesTheBitsOfRoundingThenNarrowing) {
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(6);
  auto x = torch::randn({6000}, generator) * 100;
  const float specials[] = {std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min() * 777,
                            0.0F,
                            -0.0F};
  for (std::size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) {
    x[static_cast<std::int64_t>(100 * i)] = specials[i];
  }
  const auto input = x.clone();
  // Two passes over elements 1000..5999 of a parameter: rounded in place, then narrowed.
  auto rounded = x.clone();
  frugal::optim::detail::round_stochastic_cpu(rounded.data_ptr<float>(), 6000, 21, 1000);
  auto two = torch::empty({6000}, torch::kBFloat16);
  frugal::optim::detail::to_bfloat16_bits(
      rounded.data_ptr<float>(), 6000,
      reinterpret_cast<std::uint16_t*>(two.data_ptr<at::BFloat16>()));
  // One pass, in two pieces at an odd place.
  auto one = torch::empty({6000}, torch::kBFloat16);
  auto* out = reinterpret_cast<std::uint16_t*>(one.data_ptr<at::BFloat16>());
  frugal::optim::detail::to_bfloat16_bits_stochastic(x.data_ptr<float>(), 2501, 21, 1000, out);
  frugal::optim::detail::to_bfloat16_bits_stochastic(x.data_ptr<float>() + 2501, 3499, 21, 3501,
                                                     out + 2501);
  EXPECT_TRUE(torch::equal(one.view(torch::kShort), two.view(torch::kShort)));
  EXPECT_TRUE(torch::equal(x.view(torch::kInt), input.view(torch::kInt)));  // x as it was
  // Not a rounding to nearest: a share of the values went the other way.
  const auto nearest = input.to(torch::kBFloat16);
  const auto finite = torch::isfinite(input);
  const auto differ = (one.view(torch::kShort) != nearest.view(torch::kShort)) & finite;
  EXPECT_GT(differ.sum().item<std::int64_t>(), 1000);
}

TEST(StochasticRounding, BfloatBitsRoundToNearestEvenAsACast) {
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(4);
  auto x = torch::randn({5000}, generator) * 1e3;
  // Ties both ways, the largest finite float, infinities, NaN, a subnormal.
  const float specials[] = {1.0F + std::ldexp(1.0F, -8),
                            1.0F + 3 * std::ldexp(1.0F, -8),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min() * 12345};
  for (std::size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) {
    x[static_cast<std::int64_t>(i)] = specials[i];
  }
  auto bits = torch::empty({5000}, torch::kBFloat16);
  frugal::optim::detail::to_bfloat16_bits(
      x.data_ptr<float>(), 5000, reinterpret_cast<std::uint16_t*>(bits.data_ptr<at::BFloat16>()));
  const auto cast = x.to(torch::kBFloat16);
  // Bit for bit but NaN, whose bits a cast chooses by its own path (LibTorch's vectorized
  // cast gives all ones, its scalar one 0x7FC0): a NaN either way.
  const auto nan = torch::isnan(x);
  EXPECT_TRUE(torch::equal(bits.view(torch::kShort).masked_fill(nan, 0),
                           cast.view(torch::kShort).masked_fill(nan, 0)));
  EXPECT_TRUE(torch::isnan(bits.to(torch::kFloat32)).equal(nan));
  auto back = torch::empty({5000}, torch::kFloat32);
  frugal::optim::detail::from_bfloat16_bits(
      reinterpret_cast<const std::uint16_t*>(bits.data_ptr<at::BFloat16>()), 5000,
      back.data_ptr<float>());
  const auto widened = bits.to(torch::kFloat32);
  EXPECT_TRUE(torch::equal(back.view(torch::kInt), widened.view(torch::kInt)));
}

}  // namespace
