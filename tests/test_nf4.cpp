// NF4 (4-bit NormalFloat with double-quantized absmaxes): the codec FrozenWeights stores.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/probe.h"
#include "nn/nf4.h"

namespace fd = frugal::nn::detail;

TEST(Nf4, CodesAreTheNearestPublishedValueOfEachBlocksScaledElements) {
  const auto& v = fd::nf4_values();
  ASSERT_EQ(v.numel(), 16);
  EXPECT_EQ(v[0].item<float>(), -1.0F);
  EXPECT_EQ(v[7].item<float>(), 0.0F);
  EXPECT_EQ(v[15].item<float>(), 1.0F);
  EXPECT_TRUE(torch::equal(std::get<0>(v.sort()), v));
  const auto& map = fd::dynamic_map();
  EXPECT_EQ(map.numel(), 256);
  EXPECT_EQ(map.max().item<float>(), 1.0F);
  EXPECT_TRUE(torch::equal(std::get<0>(map.sort()), map));

  torch::manual_seed(2);
  const auto w = torch::randn({37, 29});  // 1073 elements: a tail block, an odd count
  const auto q = fd::nf4_quantize(w);
  const auto n = w.numel();
  const auto blocks = (n + 63) / 64;
  EXPECT_EQ(q.packed.numel(), (n + 1) / 2);
  EXPECT_EQ(q.qabsmax.numel(), blocks);
  EXPECT_EQ(q.bytes(), (n + 1) / 2 + blocks + 4 * ((blocks + 255) / 256) + 4);
  // Each code is a nearest NF4 value to the element over its block's true absmax.
  const auto flat = w.reshape(-1);
  const auto codes = torch::stack({q.packed.bitwise_right_shift(4), q.packed.bitwise_and(15)}, 1)
                         .reshape(-1)
                         .slice(0, 0, n)
                         .to(torch::kLong);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto block = flat.slice(0, i / 64 * 64, std::min(n, i / 64 * 64 + 64));
    const float x = flat[i].item<float>() / block.abs().max().item<float>();
    const float chosen = std::fabs(v[codes[i].item<std::int64_t>()].item<float>() - x);
    EXPECT_LE(chosen, (v - x).abs().min().item<float>() + 1e-6F) << i;
  }
  // Round trip: within half the widest gap of the values times the decoded absmax, plus
  // the absmax's own error (double quantization).
  const auto absmax = fd::nf4_absmax(q);
  const auto truth =
      torch::cat({std::get<0>(flat.slice(0, 0, n / 64 * 64).reshape({-1, 64}).abs().max(1)),
                  flat.slice(0, n / 64 * 64).abs().max().view({1})});
  const auto half_gap = ((v.slice(0, 1) - v.slice(0, 0, -1)).max() / 2).item<float>();
  const auto back = fd::nf4_dequantize(q, torch::kFloat).reshape(-1);
  for (std::int64_t b = 0; b < blocks; ++b) {
    const auto part = torch::indexing::Slice(b * 64, std::min(n, b * 64 + 64));
    const float bound =
        half_gap * absmax[b].item<float>() + (absmax[b] - truth[b]).abs().item<float>() + 1e-6F;
    EXPECT_LE((back.index({part}) - flat.index({part})).abs().max().item<float>(), bound) << b;
  }
  EXPECT_LT((absmax - truth).abs().max().item<float>(), 0.01 * truth.max().item<float>());
  // bfloat16 is the float32 product rounded once.
  EXPECT_TRUE(torch::equal(fd::nf4_dequantize(q, torch::kBFloat16),
                           back.reshape({37, 29}).to(torch::kBFloat16)));
}

TEST(Nf4, TheTensorOpsPathDecodesAsTheElementLoopWithTemporariesWithinTheOutput) {
  // The path a GPU takes (tensor operations, a stretch at a time), run on the CPU through a
  // dtype the element loop does not take: the same values, and no more scratch than the
  // output's own size beyond the output (the absmaxes' decoding aside: a few floats a block).
  frugal::CountingAllocator::install();
  frugal::MemoryProbe probe(torch::kCPU);
  torch::manual_seed(4);
  for (const auto& shape : {std::vector<std::int64_t>{3, 43}, std::vector<std::int64_t>{301, 77},
                            std::vector<std::int64_t>{1024, 1031}}) {
    const auto q = fd::nf4_quantize(torch::randn(shape));
    const auto loop = fd::nf4_dequantize(q, torch::kFloat);  // the CPU's element loop
    const auto n = loop.numel();
    const auto blocks = (n + 63) / 64;
    (void)fd::nf4_dequantize(q, torch::kHalf);  // the tables, made once, made before
    torch::Tensor ops;
    {
      frugal::ScopedPeak peak(probe);
      const auto base = probe.allocated();
      ops = fd::nf4_dequantize(q, torch::kHalf);
      // The output, temporaries of at most its size (or of one stretch of 128 elements:
      // 768 bytes), and the absmaxes' decoding (an index, the values and their scaled sum:
      // under 24 bytes a block).
      const auto out_bytes = static_cast<std::int64_t>(ops.nbytes());
      EXPECT_LE(peak.end() - base,
                out_bytes + std::max<std::int64_t>(out_bytes, 768) + blocks * 24 + 1024)
          << "elements " << n;
    }
    EXPECT_EQ(ops.sizes(), loop.sizes());
    EXPECT_TRUE(torch::equal(ops, loop.to(torch::kHalf))) << "elements " << n;
    // Float64 takes the same path: the float products, widened.
    EXPECT_TRUE(torch::equal(fd::nf4_dequantize(q, torch::kDouble), loop.to(torch::kDouble)));
  }
}
