// nn::linear_cross_entropy: the loss and the gradients of hidden states, weight and bias of
// the plain linear + cross_entropy (ignore_index, label smoothing, any chunk size), exact
// under micro-batches of uneven token counts, and a step peak without the whole logits
// and their gradient, as the probe measures it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "compat.h"
#include "frugal/autocast_guard.h"
#include "frugal/loop/loop.h"
#include "frugal/memory/probe.h"
#include "frugal/memory/recorder.h"
#include "frugal/nn/linear_cross_entropy.h"
#include "helpers.h"

namespace {
namespace linear_cross_entropy {  // helper names of its own in the unity build

namespace F = torch::nn::functional;
using frugal::nn::LinearCrossEntropyOptions;

struct Head {
  torch::Tensor hidden, weight, bias, targets;
};

Head make_head(std::int64_t tokens, std::int64_t width, std::int64_t classes, bool ignored) {
  torch::manual_seed(61);
  Head h{torch::randn({tokens / 4, 4, width}).requires_grad_(true),
         (torch::randn({classes, width}) * 0.3).requires_grad_(true),
         (torch::randn({classes}) * 0.1).requires_grad_(true),
         torch::randint(classes, {tokens / 4, 4})};
  if (ignored) {
    h.targets.view({-1}).index_put_({torch::arange(0, tokens, 3)}, -100);
  }
  return h;
}

std::vector<torch::Tensor> loss_and_grads(const Head& h, const torch::Tensor& loss) {
  auto grads = torch::autograd::grad({loss}, {h.hidden, h.weight, h.bias});
  grads.insert(grads.begin(), loss.detach());
  return grads;
}

torch::Tensor plain(const Head& h, double smoothing) {
  auto logits = F::linear(h.hidden, h.weight, h.bias);
  return F::cross_entropy(
      logits.flatten(0, 1), h.targets.flatten(),
      F::CrossEntropyFuncOptions().ignore_index(-100).label_smoothing(smoothing));
}

TEST(LinearCrossEntropy, MatchesTheLinearHeadAndCrossEntropyAtEveryChunkSize) {
  const char* names[] = {"loss", "hidden's gradient", "weight's gradient", "bias's gradient"};
  for (const bool ignored : {false, true}) {
    for (const double smoothing : {0.0, 0.1}) {
      const auto h = make_head(40, 16, 37, ignored);
      const auto expected = loss_and_grads(h, plain(h, smoothing));
      for (const std::int64_t chunk : {1, 7, 40, 1000}) {
        const auto got = loss_and_grads(
            h, frugal::nn::linear_cross_entropy(
                   h.hidden, h.weight, h.bias, h.targets,
                   LinearCrossEntropyOptions().chunk(chunk).label_smoothing(smoothing)));
        for (std::size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(torch::allclose(got[i], expected[i], 1e-5, 1e-6))
              << names[i] << ", chunk " << chunk << ", smoothing " << smoothing
              << (ignored ? ", a third ignored" : "") << ": differs by "
              << (got[i] - expected[i]).abs().max().item<double>();
        }
      }
    }
  }
}

TEST(LinearCrossEntropy, NoCountedTokenGivesANanLossAndZeroGradientsAsCrossEntropyDoes) {
  for (const std::int64_t tokens : {0, 8}) {
    auto h = make_head(tokens, 16, 37, false);
    h.targets.fill_(-100);  // every target ignored (or none at all)
    for (const bool recompute : {false, true}) {
      const auto expected = loss_and_grads(h, plain(h, 0.0));
      const auto got = loss_and_grads(
          h, frugal::nn::linear_cross_entropy(h.hidden, h.weight, h.bias, h.targets,
                                              LinearCrossEntropyOptions().recompute(recompute)));
      EXPECT_TRUE(std::isnan(got[0].item<double>()) && std::isnan(expected[0].item<double>()))
          << tokens << " tokens: loss " << got[0].item<double>();
      for (std::size_t i = 1; i < got.size(); ++i) {
        EXPECT_TRUE(torch::equal(got[i], expected[i]))
            << tokens << " tokens, recompute " << recompute << ", gradient " << i;
        EXPECT_EQ(got[i].abs().sum().item<double>(), 0.0);
      }
    }
  }
}

TEST(LinearCrossEntropy, SumWithoutBiasAndUnderNoGrad) {
  auto h = make_head(24, 8, 11, true);
  h.bias = torch::Tensor();
  auto logits = F::linear(h.hidden, h.weight);
  const auto expected = F::cross_entropy(logits.flatten(0, 1), h.targets.flatten(),
                                         F::CrossEntropyFuncOptions().reduction(torch::kSum));
  const auto sum = frugal::nn::linear_cross_entropy(
      h.hidden, h.weight, torch::Tensor(), h.targets,
      LinearCrossEntropyOptions().chunk(5).reduction(frugal::nn::LinearCrossEntropyReduction::Sum));
  EXPECT_NEAR(sum.item<double>(), expected.item<double>(), 1e-4);
  auto g = torch::autograd::grad({sum}, {h.weight})[0];
  auto e = torch::autograd::grad({expected}, {h.weight})[0];
  EXPECT_TRUE(torch::allclose(g, e, 1e-5, 1e-5));
  torch::NoGradGuard no_grad;
  const auto eval =
      frugal::nn::linear_cross_entropy(h.hidden, h.weight, torch::Tensor(), h.targets);
  EXPECT_FALSE(eval.requires_grad());
  EXPECT_NEAR(eval.item<double>(), expected.item<double>() / 16.0, 1e-5);  // 16 of 24 counted
}

TEST(LinearCrossEntropy, AFloat16HeadUnderALossScaleOf65536GetsFiniteScaledGradients) {
  // A GradScaler's first scale is 65536, one more than float16 holds: the loss's gradient is
  // applied in float32, never cast to float16 itself. The float16 gradients are the float32
  // head's, scaled, to float16's precision.
  if (!FRUGAL_TORCH_AT_LEAST(2, 1)) {
    GTEST_SKIP() << "float16 products on the CPU need LibTorch 2.1 or later";
  }
  torch::manual_seed(8);
  const auto hidden = torch::randn({12, 16}) * 0.05;
  const auto weight = torch::randn({7, 16}) * 0.2;
  const auto targets = torch::randint(0, 7, {12}, torch::kLong);
  const auto sum =
      LinearCrossEntropyOptions().chunk(5).reduction(frugal::nn::LinearCrossEntropyReduction::Sum);
  const auto gradients = [&](torch::Dtype dtype, bool recompute) {
    auto h = hidden.to(dtype).detach().requires_grad_();
    auto w = weight.to(dtype).detach().requires_grad_();
    const auto loss = frugal::nn::linear_cross_entropy(
        h, w, torch::Tensor(), targets, LinearCrossEntropyOptions(sum).recompute(recompute));
    loss.backward(torch::full({}, 65536.0, loss.options()));
    return std::vector<torch::Tensor>{h.grad().to(torch::kFloat), w.grad().to(torch::kFloat)};
  };
  const auto expected = gradients(torch::kFloat, false);
  for (const auto& g : expected) {  // the scaled gradients themselves fit float16
    ASSERT_LT(g.abs().max().item<double>(), 65504.0 / 2);
  }
  for (const bool recompute : {false, true}) {
    const auto half = gradients(torch::kHalf, recompute);
    for (std::size_t i = 0; i < half.size(); ++i) {
      EXPECT_TRUE(half[i].isfinite().all().item<bool>()) << "recompute " << recompute;
      EXPECT_TRUE(torch::allclose(half[i], expected[i], 2e-2, 65536 * 1e-4))
          << "recompute " << recompute << ", gradient " << i << ": "
          << (half[i] - expected[i]).abs().max().item<double>();
    }
  }
}

TEST(LinearCrossEntropy, MicroBatchesOfUnevenTokenCountsGiveTheWholeBatchsGradient) {
  // Tokens per sample differ (a third of the targets ignored, unevenly), so each
  // micro-batch's mean must be weighted by its share of the counted tokens.
  const auto h = make_head(48, 8, 19, true);
  const auto whole = loss_and_grads(h, plain(h, 0.0));
  torch::manual_seed(3);
  torch::nn::Linear head(8, 19);
  {
    torch::NoGradGuard no_grad;
    head->weight.copy_(h.weight);
    head->bias.copy_(h.bias);
  }
  torch::optim::SGD sgd(head->parameters(), 0.0);
  frugal::Loop loop(frugal::LoopOptions().micro_batch(5).count(
      [](const frugal::Batch& b) { return b.targets.ne(-100).sum().item<std::int64_t>(); }));
  auto& m = loop.prepare(head, sgd, "head");
  const frugal::Batch batch{h.hidden.detach(), h.targets};
  const double mean = loop.accumulate(batch, m, [&](const frugal::Batch& micro) {
    return frugal::nn::linear_cross_entropy(micro.inputs, head->weight, head->bias, micro.targets,
                                            LinearCrossEntropyOptions().chunk(6));
  });
  EXPECT_NEAR(mean, whole[0].item<double>(), 1e-5);
  EXPECT_TRUE(torch::allclose(head->weight.grad(), whole[2], 1e-5, 1e-6))
      << (head->weight.grad() - whole[2]).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(head->bias.grad(), whole[3], 1e-5, 1e-6));
}

TEST(LinearCrossEntropy, ThePeakLacksTheLogitsAndTheirGradient) {
  constexpr std::int64_t kTokens = 512, kWidth = 64, kClasses = 16384;
  frugal::MemoryProbe probe(torch::kCPU, frugal::MemoryScope::Thread);
  const auto h = make_head(kTokens, kWidth, kClasses, false);
  auto peak_of = [&](const std::function<torch::Tensor()>& loss) {
    frugal::ScopedPeak region(probe);
    auto l = loss();
    l.backward();
    l = torch::Tensor();
    for (auto t : {h.hidden, h.weight, h.bias}) {
      t.mutable_grad().reset();
    }
    return region.end() - probe.allocated();
  };
  const auto plain_peak = peak_of([&] { return plain(h, 0.0); });
  const auto chunked_peak = peak_of([&] {
    return frugal::nn::linear_cross_entropy(h.hidden, h.weight, h.bias, h.targets,
                                            LinearCrossEntropyOptions().chunk(64));
  });
  const std::int64_t logits_bytes = kTokens * kClasses * 4;  // and as much for their gradient
  EXPECT_GE(plain_peak - chunked_peak, 7 * (2 * logits_bytes) / 10)
      << "peak " << plain_peak << " plain, " << chunked_peak << " chunked, logits " << logits_bytes;
}

TEST(LinearCrossEntropy, Bf16AutocastStaysCloseWithFloatAccumulation) {
  const auto h = make_head(32, 16, 23, true);
  const auto expected = plain(h, 0.0).item<double>();
  frugal::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  const auto loss = frugal::nn::linear_cross_entropy(h.hidden, h.weight, h.bias, h.targets,
                                                     LinearCrossEntropyOptions().chunk(8));
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  EXPECT_NEAR(loss.item<double>(), expected, 2e-2 * std::abs(expected));
  const auto g = torch::autograd::grad({loss}, {h.weight})[0];
  EXPECT_EQ(g.scalar_type(), torch::kFloat);
}

TEST(LinearCrossEntropy, UnderAutocastTheWeightIsCastOnceACallNotTwiceAChunk) {
  // A frozen weight, or one that is not a leaf (gathered, dequantized: autocast's cache
  // keeps no cast of either): its bf16 copy is made once for the eight chunks and both
  // products. (Frozen, so that no weight gradient of its size is made.)
  const auto h = make_head(64, 24, 37, true);
  const auto weight = h.weight.detach() * 1.0;
  const std::int64_t cast_bytes = weight.numel() * 2;
  for (const bool recompute : {false, true}) {
    frugal::MemoryRecorder recorder;
    {
      frugal::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
      const auto loss = frugal::nn::linear_cross_entropy(
          h.hidden, weight, h.bias, h.targets,
          LinearCrossEntropyOptions().chunk(8).recompute(recompute));
      torch::autograd::grad({loss}, {h.hidden, h.bias});
    }
    recorder.stop();
    std::stringstream json;
    recorder.write_to(json, ".json");
    const auto recording = nlohmann::json::parse(json.str());
    int casts = 0;
    for (const auto& e : recording.at("events")) {
      casts += e.at("action") == "alloc" && e.at("bytes") == cast_bytes ? 1 : 0;
    }
    // One a pass: the forward's, and the recompute's in backward.
    EXPECT_EQ(casts, recompute ? 2 : 1) << "recompute " << recompute;
  }
}

TEST(LinearCrossEntropy, RecomputeGivesTheSameGradientsAndKeepsNothingUntilBackward) {
  const auto h = make_head(64, 12, 37, true);
  frugal::MemoryProbe probe(torch::kCPU, frugal::MemoryScope::Thread);
  auto run = [&](bool recompute, std::int64_t* kept) {
    const auto before = probe.allocated();
    auto loss = frugal::nn::linear_cross_entropy(
        h.hidden, h.weight, h.bias, h.targets,
        LinearCrossEntropyOptions().chunk(7).label_smoothing(0.1).recompute(recompute));
    *kept = probe.allocated() - before;  // from the forward until the backward
    return loss_and_grads(h, loss);
  };
  std::int64_t kept_forward = 0, kept_recompute = 0;
  const auto forward_way = run(false, &kept_forward);
  const auto recomputed = run(true, &kept_recompute);
  const auto expected = loss_and_grads(h, plain(h, 0.1));
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_TRUE(torch::allclose(recomputed[i], forward_way[i], 1e-6, 1e-7)) << "tensor " << i;
    EXPECT_TRUE(torch::allclose(recomputed[i], expected[i], 1e-5, 1e-6)) << "tensor " << i;
  }
  // The forward way keeps the gradients of hidden, weight and bias; recomputing, the loss.
  const std::int64_t grads_bytes = (h.hidden.numel() + h.weight.numel() + h.bias.numel()) * 4;
  EXPECT_GE(kept_forward, grads_bytes);
  EXPECT_LT(kept_recompute, grads_bytes / 10) << kept_recompute;

  // Under bf16 autocast the chunks run again in bf16, as in the forward.
  frugal::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  std::int64_t ignored = 0;
  const auto bf16_forward = run(false, &ignored);
  const auto bf16_recomputed = run(true, &ignored);
  EXPECT_EQ(bf16_recomputed[2].scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(bf16_recomputed[2], bf16_forward[2], 1e-2, 1e-3));
}

TEST(LinearCrossEntropy, BadInputIsNamed) {
  const auto h = make_head(8, 4, 5, false);
  frugal::testing::expect_error_contains(
      [&] {
        frugal::nn::linear_cross_entropy(h.hidden, h.weight.narrow(1, 0, 3), h.bias, h.targets);
      },
      "do not match");
  auto bad = h.targets.clone();
  bad.view({-1})[2] = 7;
  frugal::testing::expect_error_contains(
      [&] { frugal::nn::linear_cross_entropy(h.hidden, h.weight, h.bias, bad); },
      "target 7 is not a class in [0, 5)");
  frugal::testing::expect_error_contains(
      [&] {
        frugal::nn::linear_cross_entropy(h.hidden, h.weight, h.bias, h.targets,
                                         LinearCrossEntropyOptions().chunk(0));
      },
      "chunk must be >= 1, got 0");
  frugal::testing::expect_error_contains(
      [&] {
        frugal::nn::linear_cross_entropy(h.hidden, h.weight, h.bias, h.targets.to(torch::kInt));
      },
      "class indices (int64)");
}

}  // namespace linear_cross_entropy
}  // namespace
