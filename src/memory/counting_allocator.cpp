#include "frugal/memory/counting_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "allocation_observer.h"
#include "compat.h"
#include "free_lists.h"
#include "frugal/error.h"
#include "frugal/memory/format.h"

namespace frugal {
namespace {

// Each block carries its requested size and its capacity in a header, so the deleter needs
// no lookup. The header keeps the data aligned as LibTorch's CPU allocator aligns it.
constexpr std::size_t kHeader = 64;
struct Tally;
struct Header {
  std::int64_t requested;
  std::int64_t capacity;  // the size class: what the block can hold
  Tally* owner;           // the allocating thread's figures (null: none)
};
static_assert(sizeof(Header) <= kHeader, "the block header must fit its slot");

// Installing an allocator needs a priority at least that of the one in place.
constexpr std::uint8_t kPriority = 100;

// Size classes: at least 512 bytes, then eight steps per power of two, so a block wastes
// at most an eighth of itself and a class serves every request within it.
std::int64_t size_class(std::int64_t n) {
  constexpr std::int64_t kSmallest = 512;
  if (n <= kSmallest) {
    return kSmallest;
  }
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(n));
  const std::int64_t step = std::max<std::int64_t>(kSmallest, std::int64_t{1} << (log2 - 3));
  return (n + step - 1) / step * step;
}

struct Counters {
  std::atomic<std::int64_t> allocated{0};  // requested bytes of live blocks
  std::atomic<std::int64_t> peak{0};
  std::atomic<std::int64_t> cached{0};  // capacity of free blocks kept for reuse
  std::atomic<std::int64_t> reserved_peak{0};
  std::atomic<std::int64_t> live{0};
  std::atomic<std::int64_t> total{0};
  std::atomic<std::int64_t> system{0};  // blocks ever taken from the allocator below
  std::atomic<std::int64_t> hits{0};
  std::atomic<std::int64_t> ooms{0};
  std::atomic<std::int64_t> last_refused{0};
  std::atomic<std::int64_t> cap{0};
  std::atomic<std::int64_t> capacity{0};     // size classes of live blocks
  std::atomic<std::int64_t> cache_limit{0};  // 0: the default rule
  std::atomic<std::int64_t> returned{0};     // blocks given back past the limit
};

// How many bytes of freed blocks the cache keeps once `releasing` more bytes stop being
// live: a fixed limit if one was set, else max(16 MiB, 1/32 of the live bytes) beyond the
// distance from the live bytes to their peak. The distance lets a training step keep the
// blocks its backward frees (the next step asks for the same sizes again); the allowance
// beyond it covers blocks of other size classes that wait in the cache at the step's peak.
// With trim_cache, reserved = allocated + cached stays within max(16 MiB, live / 32) of
// the peak of allocated, as with a fixed limit of that size at the peak (docs/memory.md
// has the resident memory this costs against LibTorch's allocator alone).
std::int64_t cache_limit_of(const Counters& c, std::int64_t releasing = 0) {
  const auto fixed = c.cache_limit.load();
  if (fixed > 0) {
    return fixed;
  }
  const auto live = c.allocated.load() - releasing;
  return std::max(std::int64_t{16} << 20, live / 32) +
         std::max<std::int64_t>(0, c.peak.load() - live);
}

// Never destroyed: tensors that outlive main (LibTorch's static ones) are freed through
// the allocator after static destructors have run.
Counters& counters() {
  static auto* c = new Counters();
  return *c;
}

void raise(std::atomic<std::int64_t>& peak, std::int64_t value) {
  std::int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// One thread's figures: the bytes of live blocks it allocated, wherever they are freed.
// Owned by the thread and by each of those blocks: the last one out deletes it.
struct Tally {
  std::atomic<std::int64_t> allocated{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<std::int64_t> refs{1};

  void release() {
    if (refs.fetch_sub(1) == 1) {
      delete this;
    }
  }
};

// The calling thread's tally; null while the thread is being torn down.
class ThreadTally {
 public:
  ~ThreadTally() {
    gone_ = true;
    if (tally_ != nullptr) {
      tally_->release();
    }
  }
  static Tally* get() {
    if (gone_) {
      return nullptr;
    }
    thread_local ThreadTally handle;
    if (handle.tally_ == nullptr) {
      handle.tally_ = new Tally();
    }
    return handle.tally_;
  }

 private:
  Tally* tally_ = nullptr;
  static thread_local bool gone_;
};
thread_local bool ThreadTally::gone_ = false;

class Counting final : public compat::AllocatorBase {
 public:
  c10::Allocator* inner = nullptr;
  c10::DeleterFnPtr inner_free = nullptr;
  mutable detail::FreeLists cache;

  c10::DataPtr allocate_bytes(std::size_t n) const override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) {
      return {nullptr, nullptr, &release, cpu};
    }
    auto& c = counters();
    const auto bytes = static_cast<std::int64_t>(n);
    const auto capacity = size_class(bytes);
    const std::int64_t now = c.allocated.fetch_add(bytes) + bytes;
    const std::int64_t cap = c.cap.load();
    if (cap > 0 && now + c.cached.load() > cap) {
      // As on CUDA: past the cap, the cache goes back first; only live tensors count.
      release_cache();
      if (now > cap) {
        c.allocated.fetch_sub(bytes);
        c.ooms.fetch_add(1);
        c.last_refused.store(bytes);
        detail::tell_observer(
            [&](detail::AllocationObserver& o) { o.on_refused(bytes, now - bytes, cap); });
        TORCH_CHECK_WITH(
            OutOfMemoryError, false,
            fmt::format("frugal: out of memory: CPU allocation of {} refused: "
                        "the cap is {} and {} are already allocated",
                        format_bytes(bytes), format_bytes(cap), format_bytes(now - bytes)));
      }
    }
    void* base = cache.take(capacity);
    if (base != nullptr) {
      c.cached.fetch_sub(capacity);
      c.hits.fetch_add(1);
    } else {
      try {
        base = inner->raw_allocate(static_cast<std::size_t>(capacity) + kHeader);
      } catch (...) {
        c.allocated.fetch_sub(bytes);
        throw;
      }
      c.system.fetch_add(1);
      trim_cache();
    }
    Tally* owner = ThreadTally::get();
    if (owner != nullptr) {
      owner->refs.fetch_add(1, std::memory_order_relaxed);
      raise(owner->peak, owner->allocated.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    }
    *static_cast<Header*>(base) = Header{bytes, capacity, owner};
    c.capacity.fetch_add(capacity);
    raise(c.peak, now);
    raise(c.reserved_peak, now + c.cached.load());
    c.live.fetch_add(1);
    c.total.fetch_add(1);
    void* data = static_cast<char*>(base) + kHeader;
    detail::tell_observer(
        [&](detail::AllocationObserver& o) { o.on_alloc(data, bytes, capacity, now); });
    return {data, data, &release, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  static void release(void* data);

  // Returns every cached block to the allocator below.
  // Returns how many blocks went back to the system.
  std::int64_t release_cache(std::int64_t bytes = std::numeric_limits<std::int64_t>::max()) const {
    const auto blocks = cache.drain(bytes);
    for (const auto& [base, capacity] : blocks) {
      counters().cached.fetch_sub(capacity);
      inner_free(base);
    }
    return static_cast<std::int64_t>(blocks.size());
  }

  // After a block came from the system: live bytes grew past what the cache kept blocks
  // for, so the cache gives back what is now over its limit, and reserved stays bounded.
  void trim_cache() const {
    auto& c = counters();
    const auto excess = c.cached.load() - cache_limit_of(c);
    if (excess > 0) {
      c.returned.fetch_add(release_cache(excess));
    }
  }
};

Counting& counting() {
  static auto* allocator = new Counting();  // never destroyed, as counters()
  return *allocator;
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
  const Header header = *static_cast<Header*>(base);
  auto& c = counters();
  c.capacity.fetch_sub(header.capacity);
  // Cached before it stops counting as allocated: reserved never dips below what is held.
  // Past the cache's limit the block goes back to the system instead.
  const bool keep = c.cached.load() + header.capacity <= cache_limit_of(c, header.requested);
  if (keep) {
    c.cached.fetch_add(header.capacity);
    counting().cache.put(base, header.capacity);
  }
  const std::int64_t now = c.allocated.fetch_sub(header.requested) - header.requested;
  if (!keep) {
    c.returned.fetch_add(1);
    counting().inner_free(base);
  }
  raise(c.reserved_peak, now + c.cached.load());
  c.live.fetch_sub(1);
  detail::tell_observer([&](detail::AllocationObserver& o) {
    o.on_free(data, header.requested, header.capacity, now);
  });
  if (header.owner != nullptr) {
    header.owner->allocated.fetch_sub(header.requested, std::memory_order_relaxed);
    header.owner->release();
  }
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
    FRUGAL_CHECK(a.inner_free != nullptr,
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
  s.cached = c.cached.load();
  s.reserved = s.allocated + s.cached;
  s.peak_reserved = std::max(c.reserved_peak.load(), s.reserved);
  s.allocations = c.live.load();
  s.total_allocations = c.total.load();
  s.system_allocations = c.system.load();
  s.cache_hits = c.hits.load();
  s.ooms = c.ooms.load();
  s.last_refused = c.last_refused.load();
  s.cap = c.cap.load();
  s.rounding = c.capacity.load() - s.allocated;
  s.cache_limit = cache_limit_of(c);
  s.returned = c.returned.load();
  return s;
}

void CountingAllocator::reset_peak() {
  auto& c = counters();
  c.peak.store(c.allocated.load());
  c.reserved_peak.store(c.allocated.load() + c.cached.load());
}

CpuThreadStats CountingAllocator::thread_stats() {
  const Tally* t = ThreadTally::get();
  return t == nullptr ? CpuThreadStats{} : CpuThreadStats{t->allocated.load(), t->peak.load()};
}

void CountingAllocator::reset_thread_peak() {
  if (Tally* t = ThreadTally::get()) {
    t->peak.store(t->allocated.load());
  }
}

void CountingAllocator::empty_cache() { counting().release_cache(); }

void CountingAllocator::set_cap(std::int64_t bytes) {
  FRUGAL_CHECK(bytes >= 0, "frugal: the CPU allocation cap must be >= 0 bytes, got ", bytes);
  counters().cap.store(bytes);
}

std::int64_t CountingAllocator::cap() { return counters().cap.load(); }

void CountingAllocator::set_cache_limit(std::int64_t bytes) {
  FRUGAL_CHECK(bytes >= 0, "frugal: the CPU cache limit must be >= 0 bytes, got ", bytes);
  counters().cache_limit.store(bytes);
}

namespace {

// Installed when the program starts (the library's static initialisation, before main), so
// that every tensor a program makes, its model's weights included, is counted: no probe
// has to come first. FRUGAL_COUNTING_ALLOCATOR=0 leaves LibTorch's allocator in place
// until a probe installs it.
[[maybe_unused]] const bool installed_at_start = [] {
  const char* env = std::getenv("FRUGAL_COUNTING_ALLOCATOR");
  if (env != nullptr && std::string(env) == "0") {
    return false;
  }
  CountingAllocator::install();
  return true;
}();

}  // namespace

ScopedCpuCap::ScopedCpuCap(std::int64_t bytes) : previous_(CountingAllocator::cap()) {
  CountingAllocator::install();
  CountingAllocator::set_cap(bytes);
}

ScopedCpuCap::~ScopedCpuCap() { CountingAllocator::set_cap(previous_); }

namespace detail {

std::int64_t counted_bytes(const c10::DataPtr& ptr) {
  if (ptr.get() == nullptr || ptr.get_deleter() != &Counting::release) {
    return -1;
  }
  return static_cast<const Header*>(
             static_cast<const void*>(static_cast<const char*>(ptr.get()) - kHeader))
      ->requested;
}

}  // namespace detail
}  // namespace frugal
