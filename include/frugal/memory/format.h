// Human-readable byte counts.
#pragma once

#include <cstdint>
#include <string>

namespace frugal {

/// Formats a byte count with binary units: "512 B", "1.50 KiB", "3.00 MiB", "-2.00 MiB".
std::string format_bytes(std::int64_t bytes);

}  // namespace frugal
