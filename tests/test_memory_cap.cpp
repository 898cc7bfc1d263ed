#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"
#include "frugal/memory/memory_cap.h"
#include "helpers.h"

#ifdef FRUGAL_WITH_CUDA
#include "compat.h"
#endif

namespace {

using frugal::CountingAllocator;
using frugal::testing::expect_error_contains;

bool refused(std::int64_t floats) {
  try {
    (void)torch::empty({floats});
    return false;
  } catch (const c10::OutOfMemoryError&) {
    return true;
  }
}

TEST(MemoryCap, ACpuCapRefusesWhatPassesItAndComesOffOnAnError) {
  CountingAllocator::install();
  const auto before = CountingAllocator::cap();
  const auto base = CountingAllocator::stats().allocated;
  try {
    frugal::ScopedMemoryCap cap(torch::kCPU, base + frugal::MiB(1));
    EXPECT_EQ(CountingAllocator::cap(), base + frugal::MiB(1));
    EXPECT_FALSE(refused(frugal::KiB(128)));  // 512 KiB fits
    EXPECT_TRUE(refused(frugal::KiB(512)));   // 2 MiB does not
    throw std::runtime_error("a failure inside the capped scope");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(CountingAllocator::cap(), before);
  EXPECT_FALSE(refused(frugal::KiB(512)));
}

TEST(MemoryCap, NestedCapsComeOffInTurn) {
  CountingAllocator::install();
  const auto before = CountingAllocator::cap();
  const auto base = CountingAllocator::stats().allocated;
  {
    frugal::ScopedMemoryCap outer(torch::kCPU, base + frugal::MiB(8));
    {
      frugal::ScopedMemoryCap inner(torch::Device("cpu"), base + frugal::MiB(1));
      EXPECT_TRUE(refused(frugal::KiB(512)));
    }
    EXPECT_EQ(CountingAllocator::cap(), base + frugal::MiB(8));
    EXPECT_FALSE(refused(frugal::KiB(512)));
  }
  EXPECT_EQ(CountingAllocator::cap(), before);
}

TEST(MemoryCap, BadValuesAreNamed) {
  const auto before = CountingAllocator::cap();
  expect_error_contains([] { frugal::ScopedMemoryCap cap(torch::kCPU, 0); }, "got 0");
  expect_error_contains([] { frugal::ScopedMemoryCap cap(torch::kCPU, -5); }, "got -5");
  expect_error_contains([] { frugal::ScopedMemoryCap cap(torch::Device("meta"), 64); }, "not meta");
  if (!torch::cuda::is_available()) {
    expect_error_contains([] { frugal::ScopedMemoryCap cap(torch::Device("cuda:0"), 64); },
                          "a memory cap on cuda:0");
  } else {
    expect_error_contains([] { frugal::ScopedMemoryCap cap(torch::Device("cuda:99"), 64); },
                          "there are only");
  }
  EXPECT_EQ(CountingAllocator::cap(), before);  // nothing half-set
}

#ifdef FRUGAL_WITH_CUDA
TEST(CudaMemoryCap, TheFractionIsTheBytesOverTheCardAndComesBackAfterAnError) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  const auto total = frugal::compat::cuda_total_memory(0);
  const double before = frugal::compat::cuda_memory_fraction(0);
  try {
    frugal::ScopedMemoryCap cap(torch::kCUDA, total / 4);
    EXPECT_NEAR(frugal::compat::cuda_memory_fraction(0), 0.25, 1e-9);
    // Past the cap the caching allocator refuses, as a smaller card would.
    EXPECT_THROW((void)torch::empty(
                     {total / 2}, torch::TensorOptions().dtype(torch::kByte).device(torch::kCUDA)),
                 c10::OutOfMemoryError);
    throw std::runtime_error("a failure inside the capped scope");
  } catch (const std::runtime_error&) {
  }
  EXPECT_DOUBLE_EQ(frugal::compat::cuda_memory_fraction(0), before);
  expect_error_contains([&] { frugal::ScopedMemoryCap cap(torch::kCUDA, total + 1); },
                        "is more than");
}
#endif

}  // namespace
