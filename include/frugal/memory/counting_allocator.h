// An exact byte counter for CPU tensors.
#pragma once

#include <atomic>
#include <cstdint>

namespace frugal {

/// Figures of the counting CPU allocator, in requested bytes.
struct CpuAllocatorStats {
  std::int64_t allocated = 0;          ///< bytes requested and not yet freed
  std::int64_t peak = 0;               ///< highest `allocated` since the last peak reset
  std::int64_t allocations = 0;        ///< live allocations
  std::int64_t total_allocations = 0;  ///< allocations ever made through the counter
  std::int64_t ooms = 0;               ///< requests refused by the cap
  std::int64_t cap = 0;                ///< the cap in bytes, 0 for none
};

/// A CPU allocator that wraps the one LibTorch had before and counts exactly the bytes
/// requested and not yet freed. It is installed with `install()` (idempotent) and counts
/// from then on; tensors allocated before keep their own deleter and are freed correctly.
/// Counters are atomic: autograd and intra-op threads allocate concurrently.
///
/// With a cap, an allocation that would take `allocated` past it throws
/// `c10::OutOfMemoryError` naming the cap, the request and the current bytes, and the
/// allocator stays usable. That makes out-of-memory handling testable on a CPU.
///
/// Example:
///   frugal::CountingAllocator::install();
///   auto t = torch::empty({1024});                        // +4096 bytes
///   auto s = frugal::CountingAllocator::stats();
class CountingAllocator {
 public:
  /// Installs the counter as LibTorch's CPU allocator. Calling it again does nothing.
  static void install();
  /// Puts the previous allocator back; tensors the counter allocated stay valid.
  static void uninstall();
  static bool installed();

  static CpuAllocatorStats stats();
  /// Sets the peak to the current allocated bytes.
  static void reset_peak();
  /// Refuses allocations that would take allocated bytes past `bytes`; 0 removes the cap.
  static void set_cap(std::int64_t bytes);
  static std::int64_t cap();
};

/// Installs the counter and a cap for a scope, restoring the previous cap on exit.
///
/// Example:
///   frugal::ScopedCpuCap cap(64 << 20);  // 64 MiB for this scope
class ScopedCpuCap {
 public:
  explicit ScopedCpuCap(std::int64_t bytes);
  ~ScopedCpuCap();
  ScopedCpuCap(const ScopedCpuCap&) = delete;
  ScopedCpuCap& operator=(const ScopedCpuCap&) = delete;

 private:
  std::int64_t previous_;
};

}  // namespace frugal
