#include "frugal/memory/counting_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <mutex>

#include "frugal/compat.h"
#include "frugal/memory/format.h"

namespace frugal {
namespace {

// Each block carries its requested size in a header, so the deleter needs no lookup.
// The header keeps the data aligned as LibTorch's CPU allocator aligns it.
constexpr std::size_t kHeader = 64;

// Installing an allocator needs a priority at least that of the one in place.
constexpr std::uint8_t kPriority = 100;

struct Counters {
  std::atomic<std::int64_t> allocated{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<std::int64_t> live{0};
  std::atomic<std::int64_t> total{0};
  std::atomic<std::int64_t> ooms{0};
  std::atomic<std::int64_t> cap{0};
};

Counters& counters() {
  static Counters c;
  return c;
}

void raise_peak(std::int64_t value) {
  auto& peak = counters().peak;
  std::int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

class Counting final : public compat::AllocatorBase {
 public:
  c10::Allocator* inner = nullptr;
  c10::DeleterFnPtr inner_free = nullptr;

  c10::DataPtr allocate_bytes(std::size_t n) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &release, cpu};
    }
    auto& c = counters();
    const auto bytes = static_cast<std::int64_t>(n);
    const std::int64_t now = c.allocated.fetch_add(bytes) + bytes;
    const std::int64_t cap = c.cap.load();
    if (cap > 0 && now > cap) {
      c.allocated.fetch_sub(bytes);
      c.ooms.fetch_add(1);
      TORCH_CHECK_WITH(OutOfMemoryError, false,
                       fmt::format("frugal: CPU allocation of {} refused: the cap is {} and {} "
                                   "are already allocated",
                                   format_bytes(bytes), format_bytes(cap),
                                   format_bytes(now - bytes)));
    }
    void* base = nullptr;
    try {
      base = inner->raw_allocate(n + kHeader);
    } catch (...) {
      c.allocated.fetch_sub(bytes);
      throw;
    }
    *static_cast<std::int64_t*>(base) = bytes;
    raise_peak(now);
    c.live.fetch_add(1);
    c.total.fetch_add(1);
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &release, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  static void release(void* data);
};

Counting& counting() {
  static Counting allocator;
  return allocator;
}

std::mutex& install_mutex() {
  static std::mutex m;
  return m;
}

void Counting::release(void* data) {
  if (data == nullptr) {
    return;
  }
  void* base = static_cast<char*>(data) - kHeader;
  const std::int64_t bytes = *static_cast<std::int64_t*>(base);
  auto& c = counters();
  c.allocated.fetch_sub(bytes);
  c.live.fetch_sub(1);
  counting().inner_free(base);
}

}  // namespace

void CountingAllocator::install() {
  std::lock_guard<std::mutex> lock(install_mutex());
  if (installed()) {
    return;
  }
  auto& a = counting();
  if (a.inner == nullptr) {
    a.inner = c10::GetCPUAllocator();
    a.inner_free = a.inner->raw_deleter();
    TORCH_CHECK(a.inner_free != nullptr,
                "frugal: the CPU allocator in place has no raw deleter and cannot be wrapped");
  }
  c10::SetCPUAllocator(&a, kPriority);
}

void CountingAllocator::uninstall() {
  std::lock_guard<std::mutex> lock(install_mutex());
  if (installed()) {
    c10::SetCPUAllocator(counting().inner, kPriority);
  }
}

bool CountingAllocator::installed() { return c10::GetCPUAllocator() == &counting(); }

CpuAllocatorStats CountingAllocator::stats() {
  const auto& c = counters();
  CpuAllocatorStats s;
  s.allocated = c.allocated.load();
  s.peak = c.peak.load();
  s.allocations = c.live.load();
  s.total_allocations = c.total.load();
  s.ooms = c.ooms.load();
  s.cap = c.cap.load();
  return s;
}

void CountingAllocator::reset_peak() {
  auto& c = counters();
  c.peak.store(c.allocated.load());
}

void CountingAllocator::set_cap(std::int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "frugal: the CPU allocation cap must be >= 0 bytes, got ", bytes);
  counters().cap.store(bytes);
}

std::int64_t CountingAllocator::cap() { return counters().cap.load(); }

ScopedCpuCap::ScopedCpuCap(std::int64_t bytes) : previous_(CountingAllocator::cap()) {
  CountingAllocator::install();
  CountingAllocator::set_cap(bytes);
}

ScopedCpuCap::~ScopedCpuCap() { CountingAllocator::set_cap(previous_); }

}  // namespace frugal
