#include "oom_backoff.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>

#include "frugal/error.h"
#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/format.h"

namespace frugal::detail {

bool is_out_of_memory(const std::exception& error) {
  return dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr;
}

std::string memory_figures(const MemoryProbe& probe) {
  const auto s = probe.snapshot();
  std::string out = fmt::format("allocated {}, peak {}, reserved {}", format_bytes(s.allocated),
                                format_bytes(s.peak_allocated), format_bytes(s.reserved));
  if (s.device.is_cpu() && CountingAllocator::cap() > 0) {
    out += fmt::format(", cap {}", format_bytes(CountingAllocator::cap()));
  }
  return out;
}

std::int64_t back_off(std::int64_t micro_batch, std::int64_t floor, const MemoryProbe& probe,
                      const std::exception& error, const char* unchanged) {
  TORCH_CHECK_WITH(OutOfMemoryError, micro_batch > floor, "frugal: out of memory at micro-batch ",
                   micro_batch, " (the floor is ", floor, "): ", memory_figures(probe), ". ",
                   unchanged, " The error was: ", error_message(error));
  probe.empty_cache();
  return std::max(floor, micro_batch / 2);
}

}  // namespace frugal::detail
