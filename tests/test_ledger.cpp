#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/memory/ledger.h"

namespace {

TEST(Ledger, LinearWithMomentumSplitsExactly) {
  frugal::MemoryProbe probe(torch::kCPU);
  const auto base = probe.allocated();
  torch::manual_seed(0);
  torch::nn::Linear layer(1000, 1000);
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  constexpr std::int64_t kWeights = 4 * (1000 * 1000 + 1000);

  auto ledger = frugal::measure_ledger(probe, *layer, &sgd);
  EXPECT_EQ(ledger.weights, kWeights);
  EXPECT_EQ(ledger.gradients, 0);
  EXPECT_EQ(ledger.other, base);  // what the process held before

  auto x = torch::randn({4, 1000});
  layer->forward(x).sum().backward();
  x = torch::Tensor();
  ledger = frugal::measure_ledger(probe, *layer, &sgd);
  EXPECT_EQ(ledger.gradients, kWeights);

  sgd.step();
  ledger = frugal::measure_ledger(probe, *layer, &sgd);
  EXPECT_EQ(ledger.optimizer, kWeights);
  EXPECT_EQ(ledger.weights + ledger.gradients + ledger.optimizer + ledger.other,
            probe.allocated());
  EXPECT_EQ(ledger.other, base);

  const auto before_zero = probe.allocated();
  for (auto& p : layer->parameters()) {
    p.mutable_grad().reset();
  }
  ledger = frugal::measure_ledger(probe, *layer, &sgd);
  EXPECT_EQ(ledger.gradients, 0);
  EXPECT_EQ(probe.allocated(), before_zero - kWeights);
}

TEST(Ledger, SharedAndViewedStoragesCountOnce) {
  frugal::MemoryProbe probe(torch::kCPU);
  torch::nn::Module tied;
  auto w = tied.register_parameter("w", torch::randn({10, 10}));
  tied.register_parameter("w_alias", w.detach());  // same storage
  tied.register_buffer("first_row", w.detach()[0]);  // a view of it
  tied.register_buffer("own", torch::zeros({5}));
  const auto ledger = frugal::measure_ledger(probe, tied);
  EXPECT_EQ(ledger.weights, 4 * (100 + 5));
}

TEST(Ledger, AdamStateIsTwoMomentsPerParameter) {
  frugal::MemoryProbe probe(torch::kCPU);
  torch::nn::Linear layer(64, 32);
  torch::optim::Adam adam(layer->parameters(), torch::optim::AdamOptions(1e-3));
  layer->forward(torch::randn({2, 64})).sum().backward();
  adam.step();
  const auto ledger = frugal::measure_ledger(probe, *layer, &adam);
  EXPECT_EQ(ledger.optimizer, 2 * ledger.weights);
}

}  // namespace
