#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>
#include <thread>
#include <vector>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/probe.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::CountingAllocator;

class CachingAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { CountingAllocator::install(); }
};

TEST_F(CachingAllocatorTest, ARepeatedStepTakesNothingFromTheSystem) {
  auto model = frugal::testing::make_mlp(64, 1024, 10);
  torch::optim::Adam adam(model->parameters());
  frugal::Trainer trainer(model, adam, [](const torch::Tensor& o, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(o, t);
  });
  torch::manual_seed(2);
  const frugal::Batch batch{torch::randn({256, 64}), torch::randint(0, 10, {256})};
  trainer.step(batch);  // the first steps fill the cache (and Adam's state)
  trainer.step(batch);
  const auto before = CountingAllocator::stats();
  for (int i = 0; i < 3; ++i) {
    trainer.step(batch);
  }
  const auto after = CountingAllocator::stats();
  EXPECT_EQ(after.system_allocations, before.system_allocations);
  EXPECT_GT(after.total_allocations - before.total_allocations, 0);
  EXPECT_EQ(after.cache_hits - before.cache_hits,
            after.total_allocations - before.total_allocations);
  EXPECT_EQ(after.allocated, before.allocated);  // allocated stays exact
  EXPECT_GT(after.cached, 0);
  frugal::empty_cache();  // after a step: all cached blocks back to the system
  const auto emptied = CountingAllocator::stats();
  EXPECT_EQ(emptied.reserved, emptied.allocated);
  EXPECT_EQ(emptied.allocated, after.allocated);
}

TEST_F(CachingAllocatorTest, EmptyCacheLeavesReservedEqualToAllocated) {
  { auto t = torch::empty({1 << 20}); }
  auto s = CountingAllocator::stats();
  EXPECT_GE(s.cached, 4 << 20);
  EXPECT_EQ(s.reserved, s.allocated + s.cached);
  frugal::empty_cache();
  s = CountingAllocator::stats();
  EXPECT_EQ(s.cached, 0);
  EXPECT_EQ(s.reserved, s.allocated);
}

TEST_F(CachingAllocatorTest, FreedBlocksPastTheCacheLimitGoBackToTheSystem) {
  frugal::empty_cache();
  CountingAllocator::set_cache_limit(3 << 20);  // room for three of the 1 MiB blocks
  const auto before = CountingAllocator::stats();
  EXPECT_EQ(before.cache_limit, 3 << 20);
  {
    std::vector<torch::Tensor> blocks;
    for (int i = 0; i < 5; ++i) {
      blocks.push_back(torch::empty({1 << 18}));  // 1 MiB each, a size class of its own
    }
  }
  const auto after = CountingAllocator::stats();
  EXPECT_EQ(after.cached - before.cached, 3 << 20);
  EXPECT_EQ(after.returned - before.returned, 2);
  EXPECT_EQ(after.reserved, after.allocated + after.cached);
  CountingAllocator::set_cache_limit(0);  // the rule: max(16 MiB, live / 32) + (peak - live)
  const auto rule = CountingAllocator::stats();
  EXPECT_EQ(rule.cache_limit, std::max(std::int64_t{16} << 20, rule.allocated / 32) +
                                  (rule.peak - rule.allocated));
  frugal::testing::expect_error_contains([] { CountingAllocator::set_cache_limit(-1); },
                                         "cache limit must be >= 0 bytes, got -1");
}

TEST_F(CachingAllocatorTest, BlocksFreedBelowThePeakStayCachedAndReservedStaysUnderIt) {
  frugal::empty_cache();
  CountingAllocator::set_cache_limit(0);
  CountingAllocator::reset_peak();
  const auto before = CountingAllocator::stats();
  // More 1 MiB blocks than the floor and the live/32 term would keep, as a backward frees.
  const auto count = std::max<std::int64_t>(32, before.allocated / 32 >> 20) + 16;
  {
    std::vector<torch::Tensor> blocks;
    for (std::int64_t i = 0; i < count; ++i) {
      blocks.push_back(torch::empty({1 << 18}));
    }
  }
  const auto freed = CountingAllocator::stats();
  EXPECT_EQ(freed.returned, before.returned);
  EXPECT_EQ(freed.cached - before.cached, count << 20);
  EXPECT_LE(freed.reserved, freed.peak);
  {
    std::vector<torch::Tensor> blocks;  // the next step takes them all back
    for (std::int64_t i = 0; i < count; ++i) {
      blocks.push_back(torch::empty({1 << 18}));
    }
    EXPECT_EQ(CountingAllocator::stats().system_allocations, freed.system_allocations);
  }
  // A larger tensor than any before raises the peak: the cache gives back what is over its
  // limit at once, so reserved stays within the allowance of the new peak.
  const auto larger = torch::empty({(count + 8) << 18});
  const auto after = CountingAllocator::stats();
  EXPECT_EQ(after.peak, after.allocated);
  EXPECT_LE(after.cached, std::max(std::int64_t{16} << 20, after.allocated / 32));
  EXPECT_LE(after.reserved, after.peak + std::max(std::int64_t{16} << 20, after.allocated / 32));
  EXPECT_GE(after.returned - freed.returned, (freed.cached - after.cached) >> 20);  // 1 MiB each
  frugal::empty_cache();
}

TEST_F(CachingAllocatorTest, TheSizeClassesRoundingIsReported) {
  const auto before = CountingAllocator::stats();
  auto t = torch::empty({250}, torch::kByte);  // 250 bytes in the smallest class, 512
  const auto after = CountingAllocator::stats();
  EXPECT_EQ(after.allocated - before.allocated, 250);
  EXPECT_EQ(after.rounding - before.rounding, 512 - 250);
}

TEST_F(CachingAllocatorTest, ACapAboveLiveTensorsButBelowTheCacheSucceedsByReleasingIt) {
  frugal::empty_cache();
  { auto cached = torch::empty({1 << 20}); }  // 4 MiB now cached
  const auto before = CountingAllocator::stats();
  ASSERT_GE(before.cached, 4 << 20);
  const std::int64_t request = 2 << 20;  // 2 MiB: a different size class
  {
    frugal::ScopedCpuCap cap(before.allocated + request + 4096);
    auto t = torch::empty({request / 4});
    const auto s = CountingAllocator::stats();
    EXPECT_EQ(s.allocated, before.allocated + request);
    EXPECT_EQ(s.cached, 0);  // given back to make room
    EXPECT_EQ(s.ooms, before.ooms);
  }
}

TEST_F(CachingAllocatorTest, ACapBelowLiveTensorsRaisesWithNothingLeaked) {
  auto live = torch::empty({1 << 18});
  const auto before = CountingAllocator::stats();
  {
    frugal::ScopedCpuCap cap(before.allocated + 1000);
    EXPECT_THROW(torch::empty({1 << 18}), c10::OutOfMemoryError);
  }
  const auto after = CountingAllocator::stats();
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.ooms, before.ooms + 1);
}

TEST_F(CachingAllocatorTest, FourThreadsOfMixedSizesKeepTheCountsExact) {
  const auto before = CountingAllocator::stats();
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<std::vector<torch::Tensor>> kept(kThreads);
  std::vector<std::int64_t> kept_bytes(kThreads, 0);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([i, &kept, &kept_bytes] {
      std::mt19937 random(i);
      std::vector<torch::Tensor> window(8);
      for (int r = 0; r < 3000; ++r) {
        // Sizes from 4 bytes to 4 MiB, freed in another order than allocated.
        const std::int64_t n = std::int64_t{1} << (random() % 21);
        window[random() % window.size()] = torch::empty({n + static_cast<std::int64_t>(random() % 7)});
      }
      for (auto& t : window) {
        if (t.defined()) {
          kept_bytes[i] += t.numel() * 4;
          kept[i].push_back(std::move(t));
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  std::int64_t expected = 0;
  for (const auto bytes : kept_bytes) {
    expected += bytes;
  }
  const auto after = CountingAllocator::stats();
  EXPECT_EQ(after.allocated - before.allocated, expected);
  EXPECT_EQ(after.reserved, after.allocated + after.cached);
  kept.clear();
  EXPECT_EQ(CountingAllocator::stats().allocated, before.allocated);
  EXPECT_EQ(CountingAllocator::stats().allocations, before.allocations);
}

}  // namespace
