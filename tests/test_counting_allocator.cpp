#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>
#include <vector>

#include "frugal/memory/counting_allocator.h"

namespace {

class CountingAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { frugal::CountingAllocator::install(); }
};

TEST_F(CountingAllocatorTest, FloatTensorAddsExactlyFourBytesPerElement) {
  const auto before = frugal::CountingAllocator::stats().allocated;
  constexpr std::int64_t n = 12345;
  {
    auto t = torch::empty({n});
    EXPECT_EQ(frugal::CountingAllocator::stats().allocated - before, 4 * n);
  }
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, before);
}

TEST_F(CountingAllocatorTest, PeakStaysAfterFree) {
  frugal::CountingAllocator::reset_peak();
  const auto before = frugal::CountingAllocator::stats();
  EXPECT_EQ(before.peak, before.allocated);
  { auto t = torch::empty({1000}, torch::kDouble); }
  const auto after = frugal::CountingAllocator::stats();
  EXPECT_EQ(after.allocated, before.allocated);
  EXPECT_EQ(after.peak, before.allocated + 8000);
}

TEST_F(CountingAllocatorTest, InstallIsIdempotent) {
  auto t = torch::empty({100});
  const auto before = frugal::CountingAllocator::stats().allocated;
  frugal::CountingAllocator::install();
  frugal::CountingAllocator::install();
  EXPECT_TRUE(frugal::CountingAllocator::installed());
  t = torch::Tensor();
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, before - 400);
}

TEST_F(CountingAllocatorTest, TensorsFromBeforeInstallAreFreedWithoutCounting) {
  frugal::CountingAllocator::uninstall();
  ASSERT_FALSE(frugal::CountingAllocator::installed());
  auto old = torch::ones({1 << 16});
  frugal::CountingAllocator::install();
  auto fresh = torch::ones({1 << 10});
  const auto with_both = frugal::CountingAllocator::stats().allocated;
  old = torch::Tensor();
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, with_both);
  fresh = torch::Tensor();
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, with_both - 4 * (1 << 10));
}

TEST_F(CountingAllocatorTest, TensorsOutliveUninstall) {
  auto t = torch::arange(1000, torch::kFloat);
  const auto with_t = frugal::CountingAllocator::stats().allocated;
  frugal::CountingAllocator::uninstall();
  EXPECT_FLOAT_EQ(t.sum().item<float>(), 999.0f * 1000.0f / 2.0f);
  t = torch::Tensor();
  frugal::CountingAllocator::install();
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, with_t - 4000);
}

TEST_F(CountingAllocatorTest, FourThreadsAreCountedExactly) {
  const auto before = frugal::CountingAllocator::stats();
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  std::vector<torch::Tensor> kept(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([i, &kept] {
      for (int r = 0; r < kRounds; ++r) {
        auto t = torch::empty({17 + i + r % 13});
      }
      kept[i] = torch::empty({1000 * (i + 1)});
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  const auto after = frugal::CountingAllocator::stats();
  EXPECT_EQ(after.allocated - before.allocated, 4 * 1000 * (1 + 2 + 3 + 4));
  EXPECT_EQ(after.allocations - before.allocations, kThreads);
  EXPECT_EQ(after.total_allocations - before.total_allocations, kThreads * (kRounds + 1));
  kept.clear();
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, before.allocated);
}

TEST_F(CountingAllocatorTest, CapThrowsOutOfMemoryNamingTheFiguresAndStaysUsable) {
  const auto before = frugal::CountingAllocator::stats();
  const std::int64_t cap = before.allocated + 4096;
  {
    frugal::ScopedCpuCap scoped(cap);
    auto fits = torch::empty({512});  // 2 KiB
    try {
      auto too_big = torch::empty({1024});  // 4 KiB more
      FAIL() << "the cap did not refuse the allocation";
    } catch (const c10::OutOfMemoryError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("4.00 KiB"), std::string::npos) << what;
      EXPECT_NE(what.find("the cap is"), std::string::npos) << what;
    }
    EXPECT_EQ(frugal::CountingAllocator::stats().ooms, before.ooms + 1);
    EXPECT_EQ(frugal::CountingAllocator::stats().allocated, before.allocated + 2048);
    auto also_fits = torch::empty({256});
    EXPECT_EQ(frugal::CountingAllocator::stats().allocated, before.allocated + 3072);
  }
  EXPECT_EQ(frugal::CountingAllocator::cap(), before.cap);
  EXPECT_EQ(frugal::CountingAllocator::stats().allocated, before.allocated);
}

TEST_F(CountingAllocatorTest, NegativeCapIsRejectedWithItsValue) {
  try {
    frugal::CountingAllocator::set_cap(-5);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("-5"), std::string::npos);
  }
}

}  // namespace
