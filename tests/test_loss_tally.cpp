// The engine's loss tally: losses summed without a host read per loss on a device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "engine/loss_tally.h"
#include "frugal/memory/counting_allocator.h"

namespace {

using frugal::detail::LossTally;

TEST(LossTally, OnTheCpuEachLossIsReadAsItComesAndSumsAsTheHostWould) {
  frugal::CountingAllocator::install();
  const auto a = torch::tensor(0.3F);
  const auto b = torch::tensor(1.7F);
  const auto before = frugal::CountingAllocator::stats().total_allocations;
  LossTally t;
  t.add(a, 0.25);
  t.add(b, 0.75);
  EXPECT_FALSE(t.pending());
  // No tensor made: each loss read as it came.
  EXPECT_EQ(frugal::CountingAllocator::stats().total_allocations, before);
  EXPECT_EQ(t.value(), static_cast<double>(0.3F) * 0.25 + static_cast<double>(1.7F) * 0.75);
}

TEST(LossTally, DeferredLossesAreSummedWhereTheyLiveAndReadOnceAsTheHostWould) {
  const auto a = torch::tensor(0.3F);
  const auto b = torch::tensor(1.7F);
  const auto c = torch::tensor(-2.1F);
  LossTally t(/*defer_cpu=*/true);
  t.add(a, 0.25);
  t.add(b, 0.75);
  EXPECT_TRUE(t.pending());  // nothing read yet
  const double first = t.value();
  EXPECT_FALSE(t.pending());
  EXPECT_EQ(first, static_cast<double>(0.3F) * 0.25 + static_cast<double>(1.7F) * 0.75);
  t.add(c, 2.0);  // after a read: the read sum goes on
  EXPECT_EQ(t.value(), first + static_cast<double>(-2.1F) * 2.0);
  t.clear();
  EXPECT_EQ(t.value(), 0.0);
}

TEST(LossTally, ANonFiniteLossLeavesTheSumNonFiniteAndACopyIsASnapshot) {
  const double inf = std::numeric_limits<double>::infinity();
  for (const bool defer : {false, true}) {
    LossTally t(defer);
    t.add(torch::tensor(1.0), 1.0);
    const LossTally before = t;  // what an out-of-memory retry puts back
    t.add(torch::tensor(std::nan("")), 0.5);
    t.add(torch::tensor(2.0), 1.0);
    EXPECT_TRUE(std::isnan(t.value())) << "defer " << defer;
    auto restored = before;
    EXPECT_EQ(restored.value(), 1.0) << "defer " << defer;
    // Infinities of both signs sum to NaN: still not finite.
    restored.add(torch::tensor(inf), 1.0);
    restored.add(torch::tensor(-inf), 1.0);
    EXPECT_FALSE(std::isfinite(restored.value())) << "defer " << defer;
  }
}

}  // namespace
