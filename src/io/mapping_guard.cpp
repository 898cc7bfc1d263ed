#include "io/mapping_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <mutex>

namespace frugal::io::detail {
namespace {

// Slots the handler reads without locks: a range is published by its base last, withdrawn
// by its base first.
struct Slot {
  std::atomic<std::uintptr_t> base{0};
  std::atomic<std::size_t> size{0};
  std::atomic<std::atomic<bool>*> truncated{nullptr};
};

constexpr int kSlots = 512;
Slot slots[kSlots];
std::uintptr_t page_size = 4096;  // read at install: sysconf is no call for a signal handler
struct sigaction previous {};
std::mutex registering;

void on_bus_error(int sig, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (auto& slot : slots) {
    const auto base = slot.base.load(std::memory_order_acquire);
    if (base == 0 || at < base || at >= base + slot.size.load(std::memory_order_relaxed)) {
      continue;
    }
    // The page left the file: a private zero page takes its place and the read goes on.
    void* start = reinterpret_cast<void*>(at & ~(page_size - 1));
    if (::mmap(start, page_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
               -1, 0) != MAP_FAILED) {
      if (auto* flag = slot.truncated.load(std::memory_order_relaxed)) {
        flag->store(true, std::memory_order_relaxed);
      }
      return;
    }
    break;
  }
  // Not ours: as the handler before would have done.
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(sig, info, context);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  } else {
    ::signal(sig, SIG_DFL);  // the fault repeats on return and ends the process as it would
  }
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    page_size = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction action {};
    action.sa_sigaction = on_bus_error;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &previous);
  });
}

}  // namespace

bool guard_mapping(void* base, std::size_t size, std::atomic<bool>* truncated) {
  install_once();
  std::lock_guard<std::mutex> lock(registering);
  for (auto& slot : slots) {
    if (slot.base.load(std::memory_order_relaxed) == 0) {
      slot.size.store(size, std::memory_order_relaxed);
      slot.truncated.store(truncated, std::memory_order_relaxed);
      slot.base.store(reinterpret_cast<std::uintptr_t>(base), std::memory_order_release);
      return true;
    }
  }
  return false;
}

void unguard_mapping(void* base) {
  std::lock_guard<std::mutex> lock(registering);
  for (auto& slot : slots) {
    if (slot.base.load(std::memory_order_relaxed) == reinterpret_cast<std::uintptr_t>(base)) {
      slot.base.store(0, std::memory_order_release);
      return;
    }
  }
}

}  // namespace frugal::io::detail
