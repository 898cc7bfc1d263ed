#include "frugal/memory/format.h"

#include <fmt/format.h>

#include <cstdlib>

namespace frugal {

std::string format_bytes(std::int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  const std::int64_t magnitude = std::llabs(bytes);
  if (magnitude < 1024) {
    return fmt::format("{} B", bytes);
  }
  double value = static_cast<double>(bytes) / 1024.0;
  std::size_t unit = 0;
  while (std::abs(value) >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  return fmt::format("{:.2f} {}", value, kUnits[unit]);
}

}  // namespace frugal
