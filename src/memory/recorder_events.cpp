// A MemoryRecorder's events as they happen: the allocators' calls (the counting CPU
// allocator's, or a CUDA device's trace), each with the calling thread's phase and unit; and
// the start and end of the recording.
#include <fmt/format.h>
#include <torch/cuda.h>

#include <chrono>

#include "../compat.h"
#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "recorder_impl.h"

namespace frugal {
namespace {

MemoryCategory category_made_in(MemoryPhase phase) {
  switch (phase) {
    case MemoryPhase::Forward:
    case MemoryPhase::Backward:
    case MemoryPhase::Recompute:
    case MemoryPhase::Evaluation:
      return MemoryCategory::Activations;
    default:
      return MemoryCategory::Other;
  }
}

}  // namespace

detail::MemoryEvent& MemoryRecorder::Impl::push(detail::EventAction action, const void* data,
                                                std::int64_t bytes, std::int64_t allocated) {
  const auto capacity = options_.capacity();
  if (size_ < capacity) {
    ring_.emplace_back();
    ++size_;
  } else {
    ++dropped_;
  }
  auto& e = event(next_seq_);
  e = detail::MemoryEvent{};
  e.seq = next_seq_++;
  e.time_us = std::chrono::duration_cast<std::chrono::microseconds>(
                  std::chrono::steady_clock::now() - start_)
                  .count();
  e.action = action;
  e.at = current_phase();
  e.address = reinterpret_cast<std::uintptr_t>(data);
  e.bytes = bytes;
  e.allocated = allocated;
  if (action != detail::EventAction::Free) {  // a free takes its block's
    e.phase = e.at;
    e.category =
        detail::materialising() ? MemoryCategory::MaterialisedWeights : category_made_in(e.at);
    e.unit = unit_index(detail::current_unit());
  }
  return e;
}

std::int32_t MemoryRecorder::Impl::unit_index(const torch::nn::Module* module) {
  if (module == nullptr) {
    return -1;
  }
  const auto it = unit_of_.find(module);
  if (it != unit_of_.end()) {
    return it->second;
  }
  units_.push_back(module->name());
  return unit_of_[module] = static_cast<std::int32_t>(units_.size() - 1);
}

void MemoryRecorder::Impl::on_alloc(const void* data, std::int64_t requested,
                                    std::int64_t /*capacity*/, std::int64_t allocated) {
  if (device_ < 0) {
    std::lock_guard<std::mutex> lock(mutex);
    alloc_locked(data, requested, allocated);
  }
}

void MemoryRecorder::Impl::on_free(const void* data, std::int64_t requested,
                                   std::int64_t /*capacity*/, std::int64_t allocated) {
  if (device_ < 0) {
    std::lock_guard<std::mutex> lock(mutex);
    free_locked(data, requested, allocated);
  }
}

void MemoryRecorder::Impl::on_refused(std::int64_t requested, std::int64_t allocated,
                                      std::int64_t cap) {
  if (device_ < 0) {
    refused(requested, allocated, cap);
  }
}

void MemoryRecorder::Impl::on_device(const detail::DeviceEvent& e) {
  if (e.device != device_) {
    return;
  }
  const auto* data = reinterpret_cast<const void*>(e.address);
  if (e.kind == detail::DeviceEvent::Kind::Refused) {
    const auto allocated = read(device_allocated_);
    refused(e.bytes, allocated, allocated + e.device_free);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (e.kind == detail::DeviceEvent::Kind::Alloc) {
    device_allocated_ += e.bytes;
    alloc_locked(data, e.bytes, device_allocated_);
  } else {
    device_allocated_ -= e.bytes;
    free_locked(data, e.bytes, device_allocated_);
  }
}

void MemoryRecorder::Impl::alloc_locked(const void* data, std::int64_t bytes,
                                        std::int64_t allocated) {
  const auto& e = push(detail::EventAction::Alloc, data, bytes, allocated);
  live_[e.address] = detail::LiveBlock{bytes, e.seq, e.unit, e.phase, e.category, -1};
  end_bytes_ = allocated;
  if (allocated > peak_bytes_) {
    peak_bytes_ = allocated;
    peak_seq_ = e.seq;
  }
}

void MemoryRecorder::Impl::free_locked(const void* data, std::int64_t bytes,
                                       std::int64_t allocated) {
  auto& e = push(detail::EventAction::Free, data, bytes, allocated);
  const auto it = live_.find(e.address);
  if (it == live_.end()) {
    e.known = false;  // alive before the recording and never identified
    unattributed_ -= bytes;
  } else {
    e.phase = it->second.phase;
    e.category = it->second.category;
    e.unit = it->second.unit;
    e.label = it->second.label;
    live_.erase(it);
  }
  end_bytes_ = allocated;
}

void MemoryRecorder::Impl::refused(std::int64_t requested, std::int64_t allocated,
                                   std::int64_t cap) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    push(detail::EventAction::Refused, nullptr, requested, allocated).cap = cap;
  }
  if (!options_.oom_file().empty()) {
    // The moment users most need it: written now, before a recovery frees what was alive.
    try {
      detail::write_recording(recording(), options_.oom_file());
    } catch (const std::exception& error) {
      fmt::print(stderr,
                 "frugal: the memory recording at the refused allocation was not written: {}\n",
                 error.what());
    }
  }
}

void MemoryRecorder::Impl::start() {
  std::int64_t allocated = 0;
  if (device_ < 0) {
    CountingAllocator::install();
    allocated = CountingAllocator::stats().allocated;
  } else {
#ifdef FRUGAL_WITH_CUDA
    FRUGAL_CHECK(
        torch::cuda::is_available() && device_ < static_cast<int>(torch::cuda::device_count()),
        "frugal: a memory recorder of ", options_.device(),
        ": no such CUDA device on this machine");
    compat::cuda_initialise(device_);
    compat::cuda_attach_trace();
    // Read before the lock: the allocator's lock is taken while ours is wanted, never after.
    // The trace gives each block's request, not the block (rounded to 512 bytes, a large one
    // to the part of a segment it did not split): the recording counts requests throughout.
    allocated = compat::cuda_allocator_stats(device_).requested;
#else
    FRUGAL_CHECK(false, "frugal: a memory recorder of ", options_.device(),
                 ": this LibTorch was built without CUDA");
#endif
  }
  const auto names = detail::live_names();  // let go after the lock (see watch)
  std::lock_guard<std::mutex> lock(mutex);
  detail::set_allocation_observer(this);  // one at a time: an error if one records already
  start_ = std::chrono::steady_clock::now();
  start_bytes_ = end_bytes_ = peak_bytes_ = unattributed_ = device_allocated_ = allocated;
  recording_ = true;
  name_blocks_locked(names);
}

void MemoryRecorder::Impl::stop() {
  {
    const auto names = detail::live_names();  // let go after the lock (see watch)
    std::lock_guard<std::mutex> lock(mutex);
    if (!recording_) {
      return;
    }
    classify_locked(names);
    recording_ = false;
  }
  detail::set_allocation_observer(nullptr);  // waits for calls in flight
}

}  // namespace frugal
