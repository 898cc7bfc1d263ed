// Block-wise 8-bit and 4-bit quantization: the dynamic maps, rounding to the nearest code
// (tensor ops and the host table), 4-bit codes two to a byte, the fused step's stochastic
// 4-bit encoder, and what blocks are for.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>

#include "frugal/optim/blockwise.h"
#include "helpers.h"
#include "optim/codebook.h"
#include "optim/codes4_kernel.h"

namespace {

namespace fo = frugal::optim;
using frugal::testing::nearest_distance;

// Heavy-tailed: a standard Cauchy sample (normal / normal), a few huge outliers.
torch::Tensor heavy_tailed(std::int64_t n) {
  return torch::randn({n}) / torch::randn({n});
}

TEST(Blockwise, MapsAreSortedAndHoldZeroAndOne) {
  for (const bool is_signed : {true, false}) {
    const auto map = fo::dynamic_map(is_signed);
    ASSERT_EQ(map.numel(), 256);
    EXPECT_TRUE(torch::equal(map, std::get<0>(map.sort())));
    EXPECT_EQ(map.max().item<float>(), 1.0F);
    EXPECT_EQ((map == 0).sum().item<int64_t>(), 1);
    EXPECT_EQ(map.min().item<float>() < 0, is_signed);
    EXPECT_EQ(std::get<0>(at::_unique(map)).numel(), 256);  // 256 distinct codes
  }
  // Adam's second moment: no zero, its place taken by half the smallest positive value.
  const auto no_zero = fo::dynamic_map(false, false), with_zero = fo::dynamic_map(false);
  EXPECT_EQ(no_zero[0].item<float>(), with_zero[1].item<float>() / 2);
  EXPECT_TRUE(torch::equal(no_zero.narrow(0, 1, 255), with_zero.narrow(0, 1, 255)));
  EXPECT_THROW(fo::dynamic_map(true, false), c10::Error);
}

TEST(Blockwise, EachElementGetsTheNearestCodeOfItsBlock) {
  torch::manual_seed(21);
  const std::int64_t n = 10 * 256 + 77;  // a shorter last block
  for (const bool is_signed : {true, false}) {
    const auto map = fo::dynamic_map(is_signed);
    for (const auto& [name, x0] :
         {std::pair<const char*, torch::Tensor>{"normal", torch::randn({n})},
          {"heavy-tailed", heavy_tailed(n)}}) {
      SCOPED_TRACE(::testing::Message() << name << (is_signed ? " signed" : " unsigned"));
      const auto x = is_signed ? x0 : x0.abs();
      const auto q = fo::quantize_blockwise(x, map, 256);
      ASSERT_EQ(q.scales.numel(), 11);
      const auto y = fo::dequantize_blockwise(q, map);
      // Each scale is its block's absolute maximum; the element that sets it is exact
      // when positive (the map holds 1).
      const auto padded = torch::cat({x.abs(), torch::zeros({11 * 256 - n})}).view({11, 256});
      EXPECT_TRUE(torch::equal(q.scales, std::get<0>(padded.max(1))));
      // Rounded to the nearest code: the error is the distance to the nearest map value.
      const auto scale = q.scales.repeat_interleave(256).narrow(0, 0, n);
      const auto error = (y - x).abs() / scale;
      const auto best = nearest_distance(x / scale, map);
      EXPECT_LE((error - best).max().item<double>(), 1e-6);
      // The map's bound: in the top decade, [0.1, 1] of the block's maximum, the codes are
      // 0.9/64 apart (signed) or 0.9/128 (unsigned); half that is the largest error.
      const auto top = (x.abs() / scale) >= 0.1;
      const double half_gap = 0.9 / (is_signed ? 128 : 256);
      EXPECT_LE(error.masked_select(top).max().item<double>(), half_gap * (1 + 1e-5));
    }
  }
}

TEST(Blockwise, TheHostTableRoundsToTheNearestCode) {
  // The fused CPU step rounds through a table over the float's bits; across nine decades
  // of magnitudes it picks a code exactly as near as the nearest one.
  torch::manual_seed(23);
  for (const bool is_signed : {true, false}) {
    const auto map = fo::moment_map(is_signed);
    const auto& table = fo::nearest_code(is_signed);
    auto y = torch::pow(10.0, torch::rand({100000}) * -9);
    if (is_signed) {
      y = y * (torch::randint(0, 2, {100000}) * 2 - 1);
    }
    y = torch::cat({y, map, torch::zeros({1}), torch::ones({1})});  // and the codes themselves
    const auto best = nearest_distance(y, map);
    auto codes = torch::empty({y.numel()}, torch::kLong);
    for (int64_t i = 0; i < y.numel(); ++i) {
      codes[i] = table(y[i].item<float>());
    }
    const auto got = (y - map.index_select(0, codes)).abs();
    EXPECT_LE((got - best).max().item<double>(), 0) << (is_signed ? "signed" : "unsigned");
  }
}

TEST(Blockwise, BlocksKeepOutliersFromSwampingTheRest) {
  // The point of blocks (Dettmers et al. 2021): with one scale for the whole tensor, an
  // outlier pushes most values into the coarse bottom of the map.
  torch::manual_seed(22);
  const auto x = heavy_tailed(1 << 16);
  const auto map = fo::dynamic_map(true);
  const auto error = [&](std::int64_t block) {
    const auto y = fo::dequantize_blockwise(fo::quantize_blockwise(x, map, block), map);
    return ((y - x).abs() / x.abs().clamp_min(1e-12)).median().item<double>();
  };
  const double blockwise = error(256), whole = error(x.numel());
  std::cout << "[ 8-bit    ] median relative error, Cauchy sample: blocks of 256 " << blockwise
            << ", one scale " << whole << "\n";
  EXPECT_LT(blockwise * 2, whole);
}

TEST(Blockwise, FourBitMapsHaveSixteenValuesOverThreeDecades) {
  for (const bool is_signed : {true, false}) {
    const auto map = fo::dynamic_map(is_signed, true, 4);
    ASSERT_EQ(map.numel(), 16);
    EXPECT_TRUE(torch::equal(map, std::get<0>(map.sort())));
    EXPECT_EQ(std::get<0>(at::_unique(map)).numel(), 16);
    EXPECT_EQ(map.max().item<float>(), 1.0F);
    EXPECT_EQ((map == 0).sum().item<int64_t>(), 1);
    // The smallest magnitude is the middle of the first step of the 10^-2 decade.
    const auto smallest = map.abs().masked_select(map != 0).min().item<double>();
    EXPECT_NEAR(smallest, is_signed ? 0.0055 : 0.01 * (0.1 + 0.225), 1e-7);
  }
  EXPECT_NEAR(fo::dynamic_map(true, true, 4).min().item<double>(), -0.8875, 1e-6);
  const auto no_zero = fo::dynamic_map(false, false, 4),
             with_zero = fo::dynamic_map(false, true, 4);
  EXPECT_EQ(no_zero[0].item<float>(), with_zero[1].item<float>() / 2);
  EXPECT_THROW(fo::dynamic_map(true, true, 6), c10::Error);
}

TEST(Blockwise, FourBitCodesAreTheNearestAndTwoToAByte) {
  torch::manual_seed(24);
  const std::int64_t n = 10 * 128 + 77;  // odd: the last byte holds one code
  for (const bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    const auto map = fo::dynamic_map(is_signed, true, 4);
    const auto x = is_signed ? torch::randn({n}) : torch::randn({n}).abs();
    const auto q = fo::quantize_blockwise(x.view({n, 1}), map, 128);
    ASSERT_EQ(q.codes.numel(), (n + 1) / 2);
    ASSERT_EQ(q.scales.numel(), 11);
    const auto y = fo::dequantize_blockwise(q, map);
    ASSERT_EQ(y.sizes(), (std::vector<std::int64_t>{n, 1}));
    const auto scale = q.scales.repeat_interleave(128).narrow(0, 0, n);
    const auto error = (y.view(-1) - x).abs() / scale;
    EXPECT_LE((error - nearest_distance(x / scale, map)).max().item<double>(), 1e-6);
    // The layout: the codes rounding picks, element 2k in byte k's low half.
    const auto codes =
        torch::bucketize(x / scale, (map.narrow(0, 0, 15) + map.narrow(0, 1, 15)) / 2)
            .to(torch::kInt);
    const auto bytes = q.codes.to(torch::kInt);
    EXPECT_TRUE(torch::equal(bytes.bitwise_and(15), codes.slice(0, 0, n, 2)));
    EXPECT_TRUE(
        torch::equal(bytes.narrow(0, 0, n / 2).bitwise_right_shift(4), codes.slice(0, 1, n, 2)));
    EXPECT_EQ(bytes[n / 2].item<int>() >> 4, 0);  // the last byte's empty half
  }
  // Two codes a byte need an even block; a map of another size is refused, named.
  const auto map = fo::dynamic_map(true, true, 4);
  EXPECT_THROW(fo::quantize_blockwise(torch::randn({10}), map, 5), c10::Error);
  EXPECT_THROW(fo::quantize_blockwise(torch::randn({10}), torch::rand({100}), 4), c10::Error);
}

TEST(Blockwise, TheHostTableRoundsToTheNearestFourBitCode) {
  torch::manual_seed(25);
  for (const bool is_signed : {true, false}) {
    const auto map = fo::dynamic_map(is_signed, is_signed, 4);
    const fo::NearestCode table(map);
    auto y = torch::pow(10.0, torch::rand({20000}) * -4);
    if (is_signed) {
      y = y * (torch::randint(0, 2, {20000}) * 2 - 1);
    }
    y = torch::cat({y, map});
    auto codes = torch::empty({y.numel()}, torch::kLong);
    for (int64_t i = 0; i < y.numel(); ++i) {
      codes[i] = table(y[i].item<float>());
    }
    EXPECT_LT(codes.max().item<int64_t>(), 16);
    const auto got = (y - map.index_select(0, codes)).abs();
    EXPECT_LE((got - nearest_distance(y, map)).max().item<double>(), 0)
        << (is_signed ? "signed" : "unsigned");
  }
}

// The fused CPU step's 4-bit encoder (vector copy for whole groups of sixteen, element by
// element for the rest) gives quantize_into's stochastic codes from the same random bits:
// on values spread over the map's range, on each map value, each midpoint, the floats
// either side of each value, and zeros; with blocks whose scale is not 1.
TEST(Blockwise, TheFusedStochasticFourBitEncoderGivesQuantizeIntosCodes) {
  torch::manual_seed(26);
  const std::int64_t block = 128;
  const std::uint64_t key = 0x5EED;
  for (const bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    const auto map = fo::moment_map(is_signed, 4);
    const auto& book = fo::nearest_code(is_signed, 4);
    const auto inf = torch::full({16}, std::numeric_limits<float>::infinity());
    auto spread = torch::pow(10.0, torch::rand({3000}) * -4);
    if (is_signed) {
      spread = spread * (torch::randint(0, 2, {3000}) * 2 - 1);
    }
    const auto y =
        torch::cat({spread, map, (map.narrow(0, 0, 15) + map.narrow(0, 1, 15)) / 2,
                    torch::nextafter(map, inf), torch::nextafter(map, -inf), torch::zeros({4})})
            .clamp(is_signed ? -1.0 : 0.0, 1.0);
    // Blocks of scales 3 and 1/7 in turn: x / scale gives the values back, or near them.
    const auto perm = torch::randperm(y.numel());
    const std::int64_t n = y.numel();  // 3000 + 16 + 15 + 32 + 4: odd, a short last block
    ASSERT_EQ(n % 2, 1);
    const auto scales = torch::arange(n)
                            .div(block, "floor")
                            .remainder(2)
                            .mul(3 - 1.0 / 7)
                            .add(1.0 / 7)
                            .to(torch::kFloat);
    const auto x = (y.index_select(0, perm) * scales).contiguous();
    const fo::CodeBook codebook(map);
    auto expected = torch::empty({fo::code_bytes(n, 4)}, torch::kUInt8);
    auto block_scales = torch::empty({fo::blocks_of(n, block)});
    fo::StochasticCodes stochastic{key, 0, torch::empty({n}), torch::empty({n})};
    fo::quantize_into(x, expected, block_scales, codebook, block, torch::empty({n}),
                      torch::empty({n}, torch::kInt), &stochastic);
    auto whole = torch::empty_like(expected), by_pairs = torch::empty_like(expected);
    const float* xs = x.data_ptr<float>();
    const auto encode = [&](std::int64_t at, float scale, std::int64_t count, torch::Tensor& out) {
      frugal::optim::detail::stochastic_codes4(xs + at, scale, book.values(), book.gaps(), key, at,
                                               count, out.data_ptr<std::uint8_t>() + at / 2);
    };
    for (std::int64_t b = 0; b * block < n; ++b) {
      const std::int64_t begin = b * block, count = std::min(block, n - begin);
      const float scale = block_scales[b].item<float>();
      encode(begin, scale, count, whole);
      for (std::int64_t i = 0; i < count; i += 2) {  // two elements a call: no vector copy
        encode(begin + i, scale, std::min<std::int64_t>(2, count - i), by_pairs);
      }
    }
    EXPECT_TRUE(torch::equal(whole, expected));
    EXPECT_TRUE(torch::equal(by_pairs, expected));
    // The choice is made: a code leaves the nearest with probability min(t, 1 - t), t the
    // value's place between the codes around it; the share that did within four sigma.
    const auto scaled = x / block_scales.repeat_interleave(block).narrow(0, 0, n);
    const auto below = (torch::bucketize(scaled, map, false, true) - 1).clamp(0, 14);
    const auto t = ((scaled - map.index_select(0, below)) /
                    (map.index_select(0, below + 1) - map.index_select(0, below)))
                       .clamp(0, 1);
    const double p = torch::minimum(t, 1 - t).mean().item<double>();
    const auto nearest = fo::quantize_blockwise(x, map, block).codes;
    const auto low = [](const torch::Tensor& c) { return c.to(torch::kInt).bitwise_and(15); };
    const double moved = (low(whole) != low(nearest)).to(torch::kDouble).mean().item<double>();
    EXPECT_GT(p, 0.05);
    EXPECT_NEAR(moved, p, 4 * std::sqrt(p * (1 - p) / (n / 2)));
  }
}

}  // namespace
