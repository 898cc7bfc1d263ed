#include "frugal/memory/probe.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/cuda.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "compat.h"
#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"

namespace frugal {
namespace detail {
namespace {

struct Peaks {
  std::int64_t allocated = 0;
  std::int64_t reserved = 0;

  void raise(const Peaks& o) {
    allocated = std::max(allocated, o.allocated);
    reserved = std::max(reserved, o.reserved);
  }
};

// What a device's allocator reports; the peaks are those since its last reset. In thread
// scope the CPU's allocated bytes and peak are the calling thread's.
MemorySnapshot read_device(torch::Device device, MemoryScope scope) {
  MemorySnapshot s;
  s.device = device;
  s.scope = scope;
  if (device.is_cpu()) {
    const auto c = CountingAllocator::stats();
    s.allocated = s.active = s.process_allocated = c.allocated;
    s.reserved = c.reserved;
    s.peak_allocated = c.peak;
    s.peak_reserved = c.peak_reserved;
    s.allocations = c.allocations;
    s.ooms = c.ooms;
    if (scope == MemoryScope::Thread) {
      const auto t = CountingAllocator::thread_stats();
      s.allocated = s.active = t.allocated;
      s.peak_allocated = t.peak;
    }
    return s;
  }
#ifdef FRUGAL_WITH_CUDA
  const auto c = compat::cuda_allocator_stats(device.index());
  s.allocated = s.process_allocated = c.allocated;
  s.peak_allocated = c.allocated_peak;
  s.reserved = c.reserved;
  s.peak_reserved = c.reserved_peak;
  s.active = c.active;
  s.allocations = c.allocations;
  s.alloc_retries = c.alloc_retries;
  s.ooms = c.ooms;
#endif
  return s;
}

void reset_device_peak(torch::Device device, MemoryScope scope) {
  if (device.is_cpu()) {
    if (scope == MemoryScope::Thread) {
      CountingAllocator::reset_thread_peak();
    } else {
      CountingAllocator::reset_peak();
    }
    return;
  }
#ifdef FRUGAL_WITH_CUDA
  compat::cuda_reset_peak(device.index());
#endif
}

torch::Device resolve(torch::Device device) {
  if (device.is_cpu()) {
    return torch::Device(torch::kCPU);
  }
  FRUGAL_CHECK(device.is_cuda(), "frugal: MemoryProbe supports cpu and cuda devices, not ",
               device.str());
#ifdef FRUGAL_WITH_CUDA
  FRUGAL_CHECK(torch::cuda::is_available(), "frugal: MemoryProbe(", device.str(),
               "): CUDA is not available here");
  const int index = device.has_index() ? device.index() : 0;
  FRUGAL_CHECK(index < static_cast<int>(torch::cuda::device_count()), "frugal: MemoryProbe(",
               device.str(), "): there are only ", torch::cuda::device_count(), " CUDA devices");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
  FRUGAL_CHECK(false, "frugal: MemoryProbe(", device.str(),
               "): this frugal was built against a LibTorch without CUDA");
#endif
}

}  // namespace
}  // namespace detail

using detail::Peaks;
using detail::read_device;
using detail::reset_device_peak;

// The allocator can only reset its peak, so whoever resets first folds the peak reached
// so far into every open region and into the probe user's peak. A region's peak is then the
// most of what was folded into it and the allocator's peak now; regions may start and end
// in any order, on any thread. In thread scope the state belongs to one thread.
struct ProbeState {
  ProbeState(torch::Device d, MemoryScope s) : device(d), scope(s) {}

  Peaks device_peaks() const {
    const auto s = read_device(device, scope);
    return {s.peak_allocated, s.peak_reserved};
  }

  void fold_and_reset() {
    const Peaks now = device_peaks();
    for (auto& region : open) {
      region.second.raise(now);
    }
    user.raise(now);
    reset_device_peak(device, scope);
  }

  std::uint64_t enter() {
    std::lock_guard<std::mutex> lock(mutex);
    fold_and_reset();
    open.emplace_back(next_id, Peaks{});
    return next_id++;
  }

  std::vector<std::pair<std::uint64_t, Peaks>>::const_iterator find(std::uint64_t id) const {
    const auto it = std::find_if(open.begin(), open.end(),
                                 [id](const auto& region) { return region.first == id; });
    TORCH_INTERNAL_ASSERT(it != open.end(), "frugal: no open peak region ", id);
    return it;
  }

  Peaks peaks_of(std::uint64_t id) const {
    Peaks p = find(id)->second;
    p.raise(device_peaks());
    return p;
  }

  Peaks leave(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    const Peaks region = peaks_of(id);
    open.erase(find(id));
    return region;
  }

  Peaks user_peaks() const {
    Peaks p = user;
    p.raise(device_peaks());
    return p;
  }

  void reset_user() {
    std::lock_guard<std::mutex> lock(mutex);
    fold_and_reset();
    user = {};
  }

  torch::Device device;
  MemoryScope scope;
  mutable std::mutex mutex;
  // Open regions and their peaks before the last reset: a few at a time (a step and its
  // phases), so a list that keeps its capacity, searched in place, allocates nothing.
  std::vector<std::pair<std::uint64_t, Peaks>> open;
  Peaks user;  // the probe user's peak before the last reset
  std::uint64_t next_id = 0;
};

namespace detail {

namespace {
std::shared_ptr<ProbeState> state_for(torch::Device device, MemoryScope scope) {
  using Key = std::pair<int, int>;
  const Key key{static_cast<int>(device.type()), static_cast<int>(device.index())};
  if (scope == MemoryScope::Thread && device.is_cpu()) {
    thread_local std::map<Key, std::shared_ptr<ProbeState>> states;
    auto& s = states[key];
    if (!s) {
      s = std::make_shared<ProbeState>(device, scope);
    }
    return s;
  }
  static std::mutex m;
  static std::map<Key, std::shared_ptr<ProbeState>> states;
  std::lock_guard<std::mutex> lock(m);
  auto& s = states[key];
  if (!s) {
    s = std::make_shared<ProbeState>(device, MemoryScope::Process);
  }
  return s;
}

// Reading the caching allocator's statistics before CUDA has allocated anything crashed
// in some releases: CUDA is initialised first.
void initialise(torch::Device device) {
  if (device.is_cpu()) {
    CountingAllocator::install();
  } else {
#ifdef FRUGAL_WITH_CUDA
    compat::cuda_initialise(device.index());
#endif
  }
}
}  // namespace
}  // namespace detail

MemoryProbe::MemoryProbe(torch::Device device, MemoryScope scope)
    : device_(detail::resolve(device)),
      scope_(device_.is_cpu() ? scope : MemoryScope::Process),
      state_(detail::state_for(device_, scope_)) {
  detail::initialise(device_);
}

MemorySnapshot MemoryProbe::snapshot() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto s = detail::read_device(device_, scope_);
  const auto p = state_->user_peaks();
  s.peak_allocated = p.allocated;
  s.peak_reserved = p.reserved;
  return s;
}

std::int64_t MemoryProbe::allocated() const {
  return detail::read_device(device_, scope_).allocated;
}

std::int64_t MemoryProbe::peak() const { return snapshot().peak_allocated; }

void MemoryProbe::reset_peak() { state_->reset_user(); }

void MemoryProbe::empty_cache() const { frugal::empty_cache(device_); }

void empty_cache(torch::Device device) {
  if (device.is_cpu()) {
    CountingAllocator::empty_cache();
    return;
  }
#ifdef FRUGAL_WITH_CUDA
  if (device.is_cuda()) {
    compat::cuda_empty_cache();
  }
#endif
}

std::string MemorySnapshot::summary() const {
  return fmt::format("{}{}: allocated {} (peak {}), reserved {} (peak {}), {} allocations{}",
                     device.str(), scope == MemoryScope::Thread ? " (this thread)" : "",
                     format_bytes(allocated), format_bytes(peak_allocated), format_bytes(reserved),
                     format_bytes(peak_reserved), allocations,
                     ooms > 0 ? fmt::format(", {} OOMs", ooms) : std::string());
}

std::string MemorySnapshot::to_json() const {
  nlohmann::json j = {{"device", device.str()},
                      {"scope", scope == MemoryScope::Thread ? "thread" : "process"},
                      {"process_allocated_bytes", process_allocated},
                      {"allocated_bytes", allocated},
                      {"peak_bytes", peak_allocated},
                      {"reserved_bytes", reserved},
                      {"peak_reserved_bytes", peak_reserved},
                      {"active_bytes", active},
                      {"allocations", allocations},
                      {"alloc_retries", alloc_retries},
                      {"ooms", ooms}};
  return j.dump();
}

ScopedPeak::ScopedPeak(const MemoryProbe& probe) : state_(probe.state_), id_(state_->enter()) {}

ScopedPeak::~ScopedPeak() {
  if (open_) {
    end();
  }
}

std::int64_t ScopedPeak::peak() const {
  if (!open_) {
    return final_peak_;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peaks_of(id_).allocated;
}

std::int64_t ScopedPeak::peak_reserved() const {
  if (!open_) {
    return final_reserved_;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peaks_of(id_).reserved;
}

std::int64_t ScopedPeak::end() {
  if (open_) {
    const auto region = state_->leave(id_);
    final_peak_ = region.allocated;
    final_reserved_ = region.reserved;
    open_ = false;
  }
  return final_peak_;
}

}  // namespace frugal
