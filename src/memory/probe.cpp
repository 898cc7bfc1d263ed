#include "frugal/memory/probe.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "frugal/compat.h"
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

// What a device's allocator reports; the peaks are those since its last reset.
MemorySnapshot read_device(torch::Device device) {
  MemorySnapshot s;
  s.device = device;
  if (device.is_cpu()) {
    const auto c = CountingAllocator::stats();
    s.allocated = s.active = c.allocated;
    s.reserved = c.reserved;
    s.peak_allocated = c.peak;
    s.peak_reserved = c.peak_reserved;
    s.allocations = c.allocations;
    s.ooms = c.ooms;
    return s;
  }
#ifdef FRUGAL_WITH_CUDA
  const auto c = compat::cuda_allocator_stats(device.index());
  s.allocated = c.allocated;
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

void reset_device_peak(torch::Device device) {
  if (device.is_cpu()) {
    CountingAllocator::reset_peak();
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
  TORCH_CHECK(device.is_cuda(), "frugal: MemoryProbe supports cpu and cuda devices, not ",
              device.str());
#ifdef FRUGAL_WITH_CUDA
  TORCH_CHECK(torch::cuda::is_available(),
              "frugal: MemoryProbe(", device.str(), "): CUDA is not available here");
  const int index = device.has_index() ? device.index() : 0;
  TORCH_CHECK(index < static_cast<int>(torch::cuda::device_count()), "frugal: MemoryProbe(",
              device.str(), "): there are only ", torch::cuda::device_count(), " CUDA devices");
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
#else
  TORCH_CHECK(false, "frugal: MemoryProbe(", device.str(),
              "): this frugal was built against a LibTorch without CUDA");
#endif
}

}  // namespace

// The device's allocator can only reset its peak, so a region that starts saves the peak
// reached so far into `saved` and resets; when it ends, what it reached is folded back into
// `floor`. The peak of region k (1-based) is the max of the device's peak, `floor` and
// saved[k..]: everything that happened since it began.
struct ProbeState {
  explicit ProbeState(torch::Device d) : device(d) {}

  Peaks device_peaks() const {
    const auto s = read_device(device);
    return {s.peak_allocated, s.peak_reserved};
  }

  Peaks peaks_since(std::size_t level) const {
    Peaks p = device_peaks();
    p.raise(floor);
    for (std::size_t i = level; i < saved.size(); ++i) {
      p.raise(saved[i]);
    }
    return p;
  }

  std::size_t enter() {
    std::lock_guard<std::mutex> lock(mutex);
    Peaks outer = device_peaks();
    outer.raise(floor);
    saved.push_back(outer);
    floor = {};
    reset_device_peak(device);
    return saved.size();
  }

  Peaks leave(std::size_t level) {
    std::lock_guard<std::mutex> lock(mutex);
    TORCH_CHECK(level == saved.size(), "frugal: ScopedPeak regions must end innermost first (",
                "ending level ", level, " while ", saved.size(), " are open)");
    Peaks region = peaks_since(level);
    floor = saved.back();
    floor.raise(region);
    saved.pop_back();
    return region;
  }

  torch::Device device;
  mutable std::mutex mutex;
  std::vector<Peaks> saved;
  Peaks floor;
};

namespace {
std::shared_ptr<ProbeState> state_for(torch::Device device) {
  static std::mutex m;
  static std::map<std::pair<int, int>, std::shared_ptr<ProbeState>> states;
  std::lock_guard<std::mutex> lock(m);
  auto& s = states[{static_cast<int>(device.type()), static_cast<int>(device.index())}];
  if (!s) {
    s = std::make_shared<ProbeState>(device);
  }
  return s;
}

// Reading the caching allocator's statistics before CUDA has allocated anything crashed
// in some releases: one small allocation initialises it.
void initialise(torch::Device device) {
  if (device.is_cpu()) {
    CountingAllocator::install();
  } else {
    (void)torch::empty({1}, torch::TensorOptions().device(device));
  }
}
}  // namespace
}  // namespace detail

MemoryProbe::MemoryProbe(torch::Device device)
    : device_(detail::resolve(device)), state_(detail::state_for(device_)) {
  detail::initialise(device_);
}

MemorySnapshot MemoryProbe::snapshot() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto s = detail::read_device(device_);
  const auto p = state_->peaks_since(0);
  s.peak_allocated = p.allocated;
  s.peak_reserved = p.reserved;
  return s;
}

std::int64_t MemoryProbe::allocated() const { return detail::read_device(device_).allocated; }

std::int64_t MemoryProbe::peak() const { return snapshot().peak_allocated; }

void MemoryProbe::reset_peak() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  TORCH_CHECK(state_->saved.empty(), "frugal: reset_peak() inside ", state_->saved.size(),
              " open ScopedPeak region(s) would lose their peaks");
  state_->floor = {};
  detail::reset_device_peak(device_);
}

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
  return fmt::format("{}: allocated {} (peak {}), reserved {} (peak {}), {} allocations{}",
                     device.str(), format_bytes(allocated), format_bytes(peak_allocated),
                     format_bytes(reserved), format_bytes(peak_reserved), allocations,
                     ooms > 0 ? fmt::format(", {} OOMs", ooms) : std::string());
}

std::string MemorySnapshot::to_json() const {
  nlohmann::json j = {{"device", device.str()},
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

ScopedPeak::ScopedPeak(const MemoryProbe& probe)
    : state_(probe.state_), level_(state_->enter()) {}

ScopedPeak::~ScopedPeak() {
  if (open_) {
    try {
      end();
    } catch (...) {
      // A destructor must not throw; a misordered region already reported itself via end().
    }
  }
}

std::int64_t ScopedPeak::peak() const {
  if (!open_) {
    return final_peak_;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peaks_since(level_).allocated;
}

std::int64_t ScopedPeak::peak_reserved() const {
  if (!open_) {
    return final_reserved_;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->peaks_since(level_).reserved;
}

std::int64_t ScopedPeak::end() {
  if (open_) {
    const auto region = state_->leave(level_);
    final_peak_ = region.allocated;
    final_reserved_ = region.reserved;
    open_ = false;
  }
  return final_peak_;
}

}  // namespace frugal
