// What the counting CPU allocator tells an observer (a MemoryRecorder) of each block.
#pragma once

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>

namespace frugal::detail {

/// What the CUDA caching allocator's trace says of one block (compat::cuda_attach_trace).
struct DeviceEvent {
  enum class Kind : std::uint8_t { Alloc, Free, Refused } kind = Kind::Alloc;
  int device = 0;
  std::uintptr_t address = 0;
  std::int64_t bytes = 0;  // the request the block serves (as the trace gives it, not rounded)
  std::int64_t device_free = 0;  // a refusal: the device's free bytes
};

/// Called on the allocating or freeing thread, after the counters moved: `allocated` is
/// the process's allocated bytes just after the event, the figure its peak is taken from.
class AllocationObserver {
 public:
  virtual ~AllocationObserver() = default;
  virtual void on_alloc(const void* data, std::int64_t requested, std::int64_t capacity,
                        std::int64_t allocated) = 0;
  virtual void on_free(const void* data, std::int64_t requested, std::int64_t capacity,
                       std::int64_t allocated) = 0;
  /// A request the cap refused (the allocation throws c10::OutOfMemoryError next).
  virtual void on_refused(std::int64_t requested, std::int64_t allocated, std::int64_t cap) = 0;
  /// A block of the CUDA caching allocator (any device): called under the allocator's lock,
  /// so it calls no LibTorch function.
  virtual void on_device(const DeviceEvent& event) = 0;
  /// A phase of the calling thread begins or ends (PhaseScope).
  virtual void on_phase_boundary() = 0;
};

/// Tells the observer, if any, that a phase begins or ends on the calling thread.
void tell_phase_boundary();

/// The observer, if any, and the calls inside it: removing one waits for them to end.
inline std::atomic<AllocationObserver*> observer{nullptr};
inline std::atomic<int> observing{0};

/// Calls `fn` on the observer, if any: when none, one load (the allocator's every block).
template <typename Fn>
void tell_observer(Fn fn) {
  if (observer.load(std::memory_order_relaxed) == nullptr) {
    return;
  }
  observing.fetch_add(1);
  if (auto* o = observer.load()) {
    fn(*o);
  }
  observing.fetch_sub(1);
}

/// Installs `observer` (null: none). At most one at a time: an error names the one in place.
/// Removing waits until no thread is inside a call of the one removed.
void set_allocation_observer(AllocationObserver* observer);

/// The requested bytes of the counting allocator's block that `ptr` holds, or -1 when
/// another allocator made it (a tensor from_blob, a memory map).
std::int64_t counted_bytes(const c10::DataPtr& ptr);

}  // namespace frugal::detail
