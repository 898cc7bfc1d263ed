#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include <nlohmann/json.hpp>

#include "frugal/memory/probe.h"
#include "helpers.h"

namespace {

TEST(MemoryProbe, AllocatedRisesByTensorBytesAndPeakStays) {
  frugal::MemoryProbe probe(torch::kCPU);
  probe.reset_peak();
  const auto base = probe.allocated();
  {
    auto t = torch::zeros({1000, 10});
    EXPECT_EQ(probe.allocated(), base + 40000);
  }
  const auto s = probe.snapshot();
  EXPECT_EQ(s.allocated, base);
  EXPECT_EQ(s.peak_allocated, base + 40000);
  EXPECT_GE(s.reserved, s.allocated + 40000);  // the freed block is cached for reuse
  probe.empty_cache();
  EXPECT_EQ(probe.snapshot().reserved, probe.snapshot().allocated);
}

TEST(MemoryProbe, ScopedPeakReportsItsOwnRegionAndOuterTheOverall) {
  frugal::MemoryProbe probe(torch::kCPU);
  probe.reset_peak();
  const auto base = probe.allocated();
  frugal::ScopedPeak outer(probe);
  { auto big = torch::empty({10000}); }  // outer only: +40000
  std::int64_t inner_peak = 0;
  {
    frugal::ScopedPeak inner(probe);
    auto small = torch::empty({1000});  // +4000
    inner_peak = inner.end();
  }
  EXPECT_EQ(inner_peak, base + 4000);
  EXPECT_EQ(outer.peak(), base + 40000);
  EXPECT_EQ(outer.end(), base + 40000);
  EXPECT_EQ(probe.peak(), base + 40000);
}

TEST(MemoryProbe, UserPeakSurvivesRegionsThatStartAfterIt) {
  frugal::MemoryProbe probe(torch::kCPU);
  probe.reset_peak();
  const auto base = probe.allocated();
  { auto big = torch::empty({50000}); }
  {
    frugal::ScopedPeak region(probe);
    EXPECT_EQ(probe.peak(), base + 200000);  // while the region runs, too
    auto t = torch::empty({10});
    EXPECT_EQ(region.peak(), base + 40);
  }
  EXPECT_EQ(probe.peak(), base + 200000);
}

TEST(MemoryProbe, InnerRegionPeakCountsForTheOuterRegion) {
  frugal::MemoryProbe probe(torch::kCPU);
  const auto base = probe.allocated();
  frugal::ScopedPeak outer(probe);
  {
    frugal::ScopedPeak inner(probe);
    auto t = torch::empty({3000});
    EXPECT_EQ(inner.end(), base + 12000);
  }
  auto after = torch::empty({10});
  EXPECT_EQ(outer.end(), base + 12000);
}

TEST(MemoryProbe, ResetPeakInsideARegionKeepsTheRegionsPeak) {
  frugal::MemoryProbe probe(torch::kCPU);
  const auto base = probe.allocated();
  frugal::ScopedPeak region(probe);
  { auto t = torch::empty({3000}); }
  probe.reset_peak();
  EXPECT_EQ(probe.peak(), base);
  EXPECT_EQ(region.end(), base + 12000);
}

TEST(MemoryProbe, RegionsMayEndInAnyOrder) {
  frugal::MemoryProbe probe(torch::kCPU);
  const auto base = probe.allocated();
  frugal::ScopedPeak outer(probe);
  { auto t = torch::empty({1000}); }
  frugal::ScopedPeak inner(probe);
  { auto t = torch::empty({500}); }
  EXPECT_EQ(outer.end(), base + 4000);
  { auto t = torch::empty({700}); }
  EXPECT_EQ(inner.end(), base + 2800);
}

TEST(MemoryProbe, ThreadScopeCountsWhatTheThreadAllocatedWhereverFreed) {
  frugal::MemoryProbe process(torch::kCPU);
  const auto before = process.allocated();
  auto bystander = torch::empty({1 << 20});  // the main thread's: not the worker's
  torch::Tensor handed_over;
  std::int64_t own = -1, peak = -1;
  std::thread worker([&] {
    frugal::MemoryProbe probe(torch::kCPU, frugal::MemoryScope::Thread);
    const auto base = probe.allocated();
    frugal::ScopedPeak region(probe);
    handed_over = torch::empty({1000});  // freed by the main thread below
    { auto t = torch::empty({250}); }
    own = probe.allocated() - base;
    peak = region.end() - base;
  });
  worker.join();
  EXPECT_EQ(own, 4000);
  EXPECT_EQ(peak, 5000);
  EXPECT_EQ(process.allocated() - before, 4000 + 4 * (1 << 20));
  handed_over = torch::Tensor();
  EXPECT_EQ(process.allocated() - before, 4 * (1 << 20));
}

TEST(MemoryProbe, JsonAndSummaryCarryTheFigures) {
  frugal::MemoryProbe probe(torch::kCPU);
  auto t = torch::empty({1 << 20});  // 4 MiB
  const auto s = probe.snapshot();
  const auto j = nlohmann::json::parse(s.to_json());
  EXPECT_EQ(j.at("allocated_bytes").get<std::int64_t>(), s.allocated);
  EXPECT_EQ(j.at("device").get<std::string>(), "cpu");
  EXPECT_NE(s.summary().find("MiB"), std::string::npos) << s.summary();
}

TEST(MemoryProbe, UnsupportedDeviceIsNamed) {
  try {
    frugal::MemoryProbe probe(torch::Device("meta"));
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("meta"), std::string::npos) << e.what();
  }
}

TEST(CudaMemoryProbe, AllocatedFollowsTheCachingAllocator) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  frugal::MemoryProbe probe(torch::kCUDA);
  probe.reset_peak();
  const auto base = probe.allocated();
  {
    // 1 MiB: a multiple of the caching allocator's 512-byte rounding.
    auto t = torch::empty({1 << 18}, torch::TensorOptions().device(torch::kCUDA));
    EXPECT_EQ(probe.allocated(), base + (1 << 20));
    frugal::ScopedPeak region(probe);
    auto u = torch::empty({1 << 16}, torch::TensorOptions().device(torch::kCUDA));
    EXPECT_EQ(region.end(), base + (1 << 20) + (1 << 18));
  }
  EXPECT_EQ(probe.allocated(), base);
  EXPECT_EQ(probe.peak(), base + (1 << 20) + (1 << 18));
  probe.empty_cache();
  EXPECT_LE(probe.snapshot().reserved, probe.snapshot().peak_reserved);
}

}  // namespace
