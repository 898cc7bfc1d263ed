// CUDA caching-allocator access; compiled only when LibTorch was built with CUDA.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <mutex>

#include "compat.h"
#include "frugal/error.h"
#include "memory/allocation_observer.h"

namespace frugal::compat {

namespace {
// StatType::AGGREGATE is the first entry in every version's stat arrays.
constexpr std::size_t kAggregate = 0;
}  // namespace

at::Tensor cuda_rng_state(int device) {
  auto gen = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cuda_rng_state(int device, const at::Tensor& state) {
  auto gen = at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

CudaAllocatorStats cuda_allocator_stats(int device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  CudaAllocatorStats out;
  out.allocated = stats.allocated_bytes[kAggregate].current;
  out.allocated_peak = stats.allocated_bytes[kAggregate].peak;
#if FRUGAL_TORCH_AT_LEAST(2, 1)
  out.requested = stats.requested_bytes[kAggregate].current;
  out.requested_peak = stats.requested_bytes[kAggregate].peak;
#endif
  out.reserved = stats.reserved_bytes[kAggregate].current;
  out.reserved_peak = stats.reserved_bytes[kAggregate].peak;
  out.active = stats.active_bytes[kAggregate].current;
  out.active_peak = stats.active_bytes[kAggregate].peak;
  out.allocations = stats.allocation[kAggregate].current;
  out.alloc_retries = stats.num_alloc_retries;
  out.ooms = stats.num_ooms;
  return out;
}

void cuda_reset_peak(int device) { c10::cuda::CUDACachingAllocator::resetPeakStats(device); }

void cuda_initialise(int device) {
  // Until a first CUDA tensor, the caching allocator knows no device: setting a fraction
  // or reading statistics then fails an internal assertion in some releases.
  (void)at::empty({1}, at::TensorOptions().device(
                           at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
}

void cuda_set_memory_fraction(double fraction, int device) {
  cuda_initialise(device);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction,
                                                     static_cast<c10::DeviceIndex>(device));
}

double cuda_memory_fraction(int device) {
  cuda_initialise(device);
  return c10::cuda::CUDACachingAllocator::getMemoryFraction(static_cast<c10::DeviceIndex>(device));
}

std::int64_t cuda_total_memory(int device) {
  return static_cast<std::int64_t>(at::cuda::getDeviceProperties(device)->totalGlobalMem);
}

void cuda_empty_cache() { c10::cuda::CUDACachingAllocator::emptyCache(); }

std::int64_t cuda_block_bytes(std::int64_t nbytes) {
  constexpr std::int64_t kMinBlock = 512;
  return nbytes < kMinBlock ? kMinBlock : (nbytes + kMinBlock - 1) / kMinBlock * kMinBlock;
}

#if FRUGAL_TORCH_AT_LEAST(2, 1)
void cuda_attach_trace() {
  static std::once_flag once;
  std::call_once(once, [] {
    using c10::cuda::CUDACachingAllocator::TraceEntry;
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const TraceEntry& entry) {
      detail::DeviceEvent e;
      switch (entry.action_) {
        case TraceEntry::ALLOC:
          e.kind = detail::DeviceEvent::Kind::Alloc;
          e.address = static_cast<std::uintptr_t>(entry.addr_);
          break;
        case TraceEntry::FREE_COMPLETED:  // a free delayed by another stream's use counts here
          e.kind = detail::DeviceEvent::Kind::Free;
          e.address = static_cast<std::uintptr_t>(entry.addr_);
          break;
        case TraceEntry::OOM:  // addr_ is the device's free bytes
          e.kind = detail::DeviceEvent::Kind::Refused;
          e.device_free = static_cast<std::int64_t>(entry.addr_);
          break;
        default:
          return;  // segments, snapshots: the reserved bytes, not the allocated
      }
      e.device = static_cast<int>(entry.device_);
      e.bytes = static_cast<std::int64_t>(entry.size_);
      detail::tell_observer([&e](detail::AllocationObserver& o) { o.on_device(e); });
    });
  });
}
#else
void cuda_attach_trace() {
  FRUGAL_CHECK(false,
               "frugal: recording CUDA memory needs LibTorch 2.1 or later (the caching "
               "allocator's trace hook); this is ",
               TORCH_VERSION);
}
#endif

CudaHostReadsForbidden::CudaHostReadsForbidden()
    : previous_(static_cast<int>(c10::cuda::warning_state().get_sync_debug_mode())) {
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
}

CudaHostReadsForbidden::~CudaHostReadsForbidden() {
  c10::cuda::warning_state().set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(previous_));
}

}  // namespace frugal::compat
