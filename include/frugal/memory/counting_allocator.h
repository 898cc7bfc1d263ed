// An exact byte counter for CPU tensors.
#pragma once

#include <atomic>
#include <cstdint>

#include "frugal/memory/format.h"

namespace frugal {

/// Figures of the counting CPU allocator: `allocated` in requested bytes, exactly.
struct CpuAllocatorStats {
  std::int64_t allocated = 0;          ///< bytes requested and not yet freed
  std::int64_t peak = 0;               ///< highest `allocated` since the last peak reset
  std::int64_t cached = 0;             ///< bytes of freed blocks kept for reuse
  std::int64_t reserved = 0;           ///< allocated + cached: what frugal holds for tensors
  std::int64_t peak_reserved = 0;      ///< highest `reserved` since the last peak reset
  std::int64_t allocations = 0;        ///< live allocations
  std::int64_t total_allocations = 0;  ///< allocations ever made through the counter
  std::int64_t system_allocations = 0;  ///< blocks ever taken from the allocator below
  std::int64_t cache_hits = 0;         ///< allocations served from the cache
  std::int64_t ooms = 0;               ///< requests refused by the cap
  std::int64_t last_refused = 0;       ///< bytes of the last request the cap refused
  std::int64_t cap = 0;                ///< the cap in bytes, 0 for none
  /// Bytes live blocks hold beyond their requests: the size classes' rounding (at most an
  /// eighth of a block; `allocated` + `rounding` is what live tensors occupy).
  std::int64_t rounding = 0;
  std::int64_t cache_limit = 0;  ///< the most `cached` may hold now
  std::int64_t returned = 0;     ///< blocks given back to the system past the cache limit
};

/// One thread's share of the counting allocator: the bytes of live blocks that thread
/// allocated (wherever they are freed), and their peak since the thread's last reset.
struct CpuThreadStats {
  std::int64_t allocated = 0;
  std::int64_t peak = 0;
};

/// A caching CPU allocator that wraps the one LibTorch had before and counts exactly the
/// bytes requested and not yet freed. It is installed with `install()` (idempotent) and
/// counts from then on; tensors allocated before keep their own deleter and are freed
/// correctly. Counters are atomic: autograd and intra-op threads allocate concurrently.
/// Each block also counts for the thread that allocated it (thread_stats()), so threads
/// that train side by side each see their own figures.
///
/// Like CUDA's caching allocator, it keeps freed blocks for reuse, in size classes (at
/// least 512 bytes, eight per power of two), so a training loop's steady-state steps take
/// nothing from the system: no mmap/munmap and no page faults for the large tensors glibc
/// would otherwise map and unmap every step. `reserved` is allocated + cached;
/// `empty_cache()` returns the cached blocks to the system. The cache is bounded, so a
/// program linked with frugal holds about the memory it would hold without it: by default
/// to max(16 MiB, 1/32 of the live bytes) beyond the distance from the live bytes to their
/// peak, so a step keeps the blocks its backward frees while reserved stays within
/// max(16 MiB, live/32) of the peak (`set_cache_limit` sets a fixed limit); a block freed
/// past the limit goes back to the system, and a block taken from the system first makes
/// the cache give back what is over the limit. Free lists are sharded by size class, each
/// shard with its own lock.
///
/// With a cap, a request that would take allocated + cached past it first returns the
/// cache to the system, as CUDA does at its memory limit; it throws `c10::OutOfMemoryError`
/// (naming the cap, the request and the current bytes) only when the live tensors alone do
/// not fit, and the allocator stays usable. That makes out-of-memory handling testable on
/// a CPU.
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
  /// The calling thread's figures (process-wide ones: stats()). Allocations LibTorch's
  /// intra-op worker threads make count for those threads, not for the caller.
  static CpuThreadStats thread_stats();
  /// Sets the calling thread's peak to its current allocated bytes.
  static void reset_thread_peak();
  /// Sets the peaks to the current allocated and reserved bytes.
  static void reset_peak();
  /// Returns the cached blocks to the allocator below (the system).
  static void empty_cache();
  /// Refuses allocations that would take allocated bytes past `bytes`; 0 removes the cap.
  static void set_cap(std::int64_t bytes);
  static std::int64_t cap();
  /// Keeps at most `bytes` of freed blocks for reuse; 0 restores the default rule,
  /// max(32 MiB, 1/32 of the live bytes).
  static void set_cache_limit(std::int64_t bytes);
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
