// The 8-bit weights' codec: groups of uint8 codes with a bfloat16 zero point and scale.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "optim/rounding.h"
#include "optim/weight_codes.h"

namespace {
namespace weight_codes_test {

namespace fd = frugal::optim::detail;

struct Coded {
  torch::Tensor codes, qparams;
};

// `x` (float32) coded by the CPU kernel from element `begin` on.
Coded kernel_codes(const torch::Tensor& x, std::int64_t group, bool stochastic, std::uint64_t key) {
  const auto n = x.numel();
  Coded c{torch::zeros({n}, torch::kUInt8),
          torch::zeros({fd::weight_groups(n, group), 2}, torch::kBFloat16)};
  fd::quantize_weights_cpu(x.contiguous().data_ptr<float>(), group, 0, n, stochastic, key,
                           c.codes.data_ptr<std::uint8_t>(),
                           reinterpret_cast<std::uint16_t*>(c.qparams.data_ptr<at::BFloat16>()));
  return c;
}

// Rounding to nearest draws no noise: no buffer for it is given (as quantize_weights gives
// none for a tensor on a device).
Coded ops_codes(const torch::Tensor& x, std::int64_t group, bool stochastic, std::uint64_t key) {
  const auto n = x.numel();
  Coded c{torch::zeros({n}, torch::kUInt8),
          torch::zeros({fd::weight_groups(n, group), 2}, torch::kBFloat16)};
  auto work = x.clone();
  fd::quantize_weights_ops(work, group, 0, stochastic, key, c.codes, c.qparams,
                           stochastic ? torch::empty({n}) : torch::Tensor(), torch::empty({n}));
  return c;
}

torch::Tensor decoded(const Coded& c, std::int64_t group) {
  auto out = torch::empty({c.codes.numel()});
  fd::dequantize_weights_cpu(
      c.codes.data_ptr<std::uint8_t>(),
      reinterpret_cast<const std::uint16_t*>(c.qparams.data_ptr<at::BFloat16>()), group, 0,
      c.codes.numel(), out.data_ptr<float>());
  return out;
}

// Each element's group's scale, repeated over the group.
torch::Tensor scale_per_element(const Coded& c, std::int64_t group) {
  return c.qparams.select(1, 1)
      .to(torch::kFloat)
      .repeat_interleave(group)
      .narrow(0, 0, c.codes.numel());
}

TEST(WeightCodes, NearestCodesAreWithinHalfAStepAndGroupsSpanTheirValues) {
  torch::manual_seed(1);
  // Groups of very different magnitudes and offsets, and a short last group.
  const auto x = torch::cat({torch::randn({128}) * 1e-3, torch::randn({128}) * 10 + 5,
                             torch::rand({128}) - 7, torch::randn({37})});
  const auto c = kernel_codes(x, 128, false, 0);
  const auto back = decoded(c, 128);
  const auto scale = scale_per_element(c, 128);
  // Half a step, and float32's rounding of zero + code * scale.
  const auto bound = scale * 0.5 + x.abs() * 2e-7;
  EXPECT_TRUE((back - x).abs().le(bound).all().item<bool>())
      << ((back - x).abs() - bound).max().item<float>();
  for (std::int64_t g = 0; g < 4; ++g) {
    const auto n = std::min<std::int64_t>(128, x.numel() - g * 128);
    const auto part = x.narrow(0, g * 128, n);
    const float zero = c.qparams[g][0].item<float>(), step = c.qparams[g][1].item<float>();
    const float lo = part.min().item<float>(), hi = part.max().item<float>();
    EXPECT_LE(zero, lo);                                      // rounded down
    EXPECT_GE(zero + 255 * step, hi - std::abs(hi) * 1e-6F);  // the codes span the group
    EXPECT_LE(step, (hi - zero) / 255 * (1 + 1.0F / 128));    // rounded up by < one bf16 step
  }
}

TEST(WeightCodes, StochasticCodesEqualTheValueInExpectation) {
  torch::manual_seed(2);
  const auto x = torch::randn({128});
  const int draws = 2000;
  auto sum = torch::zeros({128}, torch::kFloat64);
  auto sum_sq = torch::zeros({128}, torch::kFloat64);
  for (int k = 0; k < draws; ++k) {
    const auto d =
        decoded(kernel_codes(x, 128, true, fd::rounding_key(5, k)), 128).to(torch::kFloat64);
    sum += d;
    sum_sq += d * d;
  }
  const auto mean = sum / draws;
  const auto sd = (sum_sq / draws - mean * mean).clamp_min(0).sqrt();
  // Each mean is within 5 standard errors of its value (and of bf16-free float32 rounding).
  const auto se = sd / std::sqrt(static_cast<double>(draws)) + 1e-6;
  const auto z = ((mean - x.to(torch::kFloat64)).abs() / se).max().item<double>();
  EXPECT_LT(z, 5.0);
  // Nearest codes are biased for some element: stochastic rounding is what removes it.
  const auto nearest = decoded(kernel_codes(x, 128, false, 0), 128).to(torch::kFloat64);
  EXPECT_GT(((nearest - x.to(torch::kFloat64)).abs() / se).max().item<double>(), 5.0);
}

TEST(WeightCodes, TensorOperationsGiveTheKernelsCodesBitForBit) {
  torch::manual_seed(3);
  const auto x = torch::cat({torch::randn({1024}) * 0.02, torch::randn({100}) * 3});
  for (const bool stochastic : {false, true}) {
    // Groups of 1 and 2 need more statistics than the chunk-sized buffer holds at once.
    for (const std::int64_t group : {128, 64, 100, 1, 2, 3}) {
      const auto k = kernel_codes(x, group, stochastic, 77);
      const auto o = ops_codes(x, group, stochastic, 77);
      EXPECT_TRUE(torch::equal(k.codes, o.codes)) << "group " << group << " " << stochastic;
      EXPECT_TRUE(torch::equal(k.qparams.view(torch::kInt16), o.qparams.view(torch::kInt16)))
          << "group " << group << " " << stochastic;
      auto back = torch::empty({x.numel()});
      fd::dequantize_weights_ops(o.codes, o.qparams, group, back);
      EXPECT_TRUE(torch::equal(back, decoded(k, group)));
    }
  }
}

// The kernel finds a group's least and greatest value eight lanes at a time, then the
// elements left over; which of two equal zeros it keeps is not defined, so a least zero
// is taken as +0 by both codecs.
TEST(WeightCodes, GroupsWithSignedZerosAndShortTailsCodeAlikeInBothCodecs) {
  torch::manual_seed(6);
  for (const std::int64_t group : {13, 128, 131}) {
    auto x = torch::rand({4 * group});  // in [0, 1): the least of each group set below
    x[0] = -0.0F;                       // a -0 first, a +0 later
    x[5] = 0.0F;
    x[group + 3] = 0.0F;  // a +0 first, a -0 in the tail
    x[2 * group - 1] = -0.0F;
    x[2 * group + 9] = -0.5F;  // a least and a greatest value, the last element the greatest
    x[3 * group - 1] = 2.0F;
    for (const bool stochastic : {false, true}) {
      const auto k = kernel_codes(x, group, stochastic, 3);
      const auto o = ops_codes(x, group, stochastic, 3);
      EXPECT_TRUE(torch::equal(k.codes, o.codes)) << group;
      const auto bits = k.qparams.view(torch::kInt16);
      EXPECT_TRUE(torch::equal(bits, o.qparams.view(torch::kInt16))) << group;
      EXPECT_EQ(bits[0][0].item<std::int16_t>(), 0) << group;  // +0, not -0
      EXPECT_EQ(bits[1][0].item<std::int16_t>(), 0) << group;
      EXPECT_EQ(k.qparams[2][0].item<float>(), -0.5F) << group;
      // Its scale spans the greatest value, which lies in the tail of group 13 and 131.
      EXPECT_GE(-0.5F + 255 * k.qparams[2][1].item<float>(), 2.0F) << group;
    }
  }
}

TEST(WeightCodes, TensorOperationsEncodeARangeWhereItStarts) {
  torch::manual_seed(7);
  const auto x = torch::randn({640});
  const auto whole = kernel_codes(x, 128, true, 9);
  Coded c{torch::zeros({640}, torch::kUInt8), torch::zeros({5, 2}, torch::kBFloat16)};
  for (const std::int64_t begin : {0, 256}) {
    const std::int64_t n = begin == 0 ? 256 : 384;
    auto work = x.narrow(0, begin, n).clone();
    fd::quantize_weights_ops(work, 128, begin, true, 9, c.codes, c.qparams, torch::empty({n}),
                             torch::empty({n}));
  }
  EXPECT_TRUE(torch::equal(whole.codes, c.codes));
  EXPECT_TRUE(torch::equal(whole.qparams.view(torch::kInt16), c.qparams.view(torch::kInt16)));
}

TEST(WeightCodes, TheKernelsCodesDoNotDependOnWhereARangeStarts) {
  torch::manual_seed(4);
  const auto x = torch::randn({1000});
  const auto whole = kernel_codes(x, 100, true, 9);
  Coded parts{torch::zeros({1000}, torch::kUInt8), torch::zeros({10, 2}, torch::kBFloat16)};
  for (const auto& [begin, count] : {std::pair<int, int>{0, 300}, {300, 600}, {900, 100}}) {
    fd::quantize_weights_cpu(
        x.data_ptr<float>() + begin, 100, begin, count, true, 9,
        parts.codes.data_ptr<std::uint8_t>(),
        reinterpret_cast<std::uint16_t*>(parts.qparams.data_ptr<at::BFloat16>()));
  }
  EXPECT_TRUE(torch::equal(whole.codes, parts.codes));
}

TEST(WeightCodes, AGroupHoldingANonFiniteValueDecodesNonFinite) {
  auto x = torch::randn({256});
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[200] = std::numeric_limits<float>::infinity();
  for (const bool stochastic : {false, true}) {
    const auto back = decoded(kernel_codes(x, 128, stochastic, 1), 128);
    EXPECT_FALSE(torch::isfinite(back.narrow(0, 0, 128)).any().item<bool>());
    EXPECT_FALSE(torch::isfinite(back.narrow(0, 128, 128)).any().item<bool>());
    // The tensor operations (a GPU's codec) too, though their statistics' bits may differ.
    const auto o = ops_codes(x, 128, stochastic, 1);
    auto ops_back = torch::empty({256});
    fd::dequantize_weights_ops(o.codes, o.qparams, 128, ops_back);
    EXPECT_FALSE(torch::isfinite(ops_back).any().item<bool>());
  }
  const auto constant = decoded(kernel_codes(torch::full({128}, 0.3F), 128, false, 0), 128);
  EXPECT_LE((constant - 0.3F).abs().max().item<float>(), 0.3F / 256);
}

TEST(WeightCodes, WholeTensorsQuantizeAndMaterialiseThroughTheCodec) {
  torch::manual_seed(5);
  const auto w = torch::randn({40, 70});
  const auto [codes, qparams] = fd::quantize_weights(w, 128);
  const auto direct = kernel_codes(w.view(-1), 128, false, 0);
  EXPECT_TRUE(torch::equal(codes, direct.codes));
  fd::StoredWeights stored;
  stored.codes = codes;
  stored.qparams = qparams;
  stored.group = 128;
  auto out = torch::empty({40, 70}, torch::kBFloat16);
  fd::dequantize_into(stored, out);
  // bfloat16 of the decoded float32 values, rounded to nearest.
  EXPECT_TRUE(torch::equal(out, decoded(direct, 128).view({40, 70}).to(torch::kBFloat16)));
  auto wide = torch::empty({40, 70});
  fd::dequantize_into(stored, wide);
  EXPECT_TRUE(torch::equal(wide, decoded(direct, 128).view({40, 70})));
}

}  // namespace weight_codes_test
}  // namespace
