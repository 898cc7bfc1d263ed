// memory_allocated for LibTorch C++: one probe per device, scoped peaks that nest.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace frugal {

/// Whose bytes a CPU probe counts. CUDA figures are always the device's.
enum class MemoryScope {
  /// Every tensor of the process on the device: memory_allocated.
  Process,
  /// The tensors the calling thread allocated (wherever they are freed), so that trainers
  /// on different threads each see their own figures; intra-op worker threads count for
  /// themselves. Reserved bytes and the cap stay process-wide.
  Thread,
};

/// What a device's allocator holds at one moment. On the CPU (through the counting
/// allocator) `allocated` and `active` are the bytes live tensors requested, exactly, and
/// `reserved` is that plus the freed blocks the allocator caches for reuse, as on CUDA;
/// `alloc_retries` is 0 and `ooms` counts requests the cap refused.
struct MemorySnapshot {
  torch::Device device = torch::kCPU;
  MemoryScope scope = MemoryScope::Process;  ///< whose bytes `allocated` and its peak count
  std::int64_t allocated = 0;       ///< bytes held by tensors now (memory_allocated)
  std::int64_t peak_allocated = 0;  ///< highest `allocated` since the last peak reset
  std::int64_t reserved = 0;        ///< bytes the allocator holds from the system
  std::int64_t peak_reserved = 0;
  std::int64_t active = 0;       ///< bytes in blocks in use, rounding included (CUDA)
  std::int64_t allocations = 0;  ///< live allocations
  std::int64_t alloc_retries = 0;
  std::int64_t ooms = 0;
  std::int64_t process_allocated = 0;  ///< the whole process's allocated bytes, in any scope

  /// "cpu: allocated 1.50 MiB (peak 3.00 MiB), reserved 1.50 MiB (peak 3.00 MiB), ..."
  std::string summary() const;
  /// The snapshot as one JSON object, keys ending in `_bytes` for byte counts.
  std::string to_json() const;
};

/// What the probes of one device and scope share (their peaks and open regions); defined
/// inside the library.
struct ProbeState;

/// Returns the allocator's cached blocks: to the system on the CPU (frugal's counting
/// allocator), to the device on CUDA (the caching allocator's empty_cache).
void empty_cache(torch::Device device = torch::kCPU);

/// Reads memory_allocated and friends for one device.
///
/// CPU: installs the counting allocator (`CountingAllocator::install`) and reads its exact
/// counts, so only tensors allocated after the first probe is made are counted.
/// CUDA: reads the caching allocator's device statistics (only in a CUDA build).
/// All probes of one device and scope share their state (in thread scope: on one thread),
/// so scoped peaks nest across them.
///
/// Example:
///   frugal::MemoryProbe probe(torch::kCPU);
///   auto before = probe.allocated();
///   auto t = torch::ones({256, 256});
///   fmt::print("{}\n", probe.snapshot().summary());
class MemoryProbe {
 public:
  explicit MemoryProbe(torch::Device device = torch::kCPU,
                       MemoryScope scope = MemoryScope::Process);

  torch::Device device() const { return device_; }
  /// Thread only for a CPU probe made in thread scope.
  MemoryScope scope() const { return scope_; }
  MemorySnapshot snapshot() const;
  std::int64_t allocated() const;
  /// The peak since the last `reset_peak`, whatever scoped peaks ran meanwhile.
  std::int64_t peak() const;
  /// Starts a new peak at the current allocated bytes; open ScopedPeak regions keep theirs.
  void reset_peak();
  /// Returns cached blocks to the system (CPU) or the device (CUDA).
  void empty_cache() const;

 private:
  friend class ScopedPeak;
  torch::Device device_;
  MemoryScope scope_;
  std::shared_ptr<ProbeState> state_;
};

/// The peak of a region, measured without disturbing the peak that another region or the
/// probe's user is watching. Regions may overlap in any order and on any thread (a region
/// of a thread-scope probe starts and ends on its thread).
///
/// Example:
///   frugal::ScopedPeak step(probe);
///   { frugal::ScopedPeak fwd(probe); forward(); fwd_peak = fwd.end(); }
///   auto step_peak = step.end();
class ScopedPeak {
 public:
  explicit ScopedPeak(const MemoryProbe& probe);
  ~ScopedPeak();
  ScopedPeak(const ScopedPeak&) = delete;
  ScopedPeak& operator=(const ScopedPeak&) = delete;

  /// Highest allocated bytes since the region began (reserved: `peak_reserved`).
  std::int64_t peak() const;
  std::int64_t peak_reserved() const;
  /// Ends the region and returns its allocated peak; later calls return the same value.
  std::int64_t end();

 private:
  std::shared_ptr<ProbeState> state_;
  std::uint64_t id_;
  bool open_ = true;
  std::int64_t final_peak_ = 0;
  std::int64_t final_reserved_ = 0;
};

}  // namespace frugal
