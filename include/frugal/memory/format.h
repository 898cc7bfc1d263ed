// Byte counts: sizes written in binary units, and formatted for people.
#pragma once

#include <cstdint>
#include <string>

namespace frugal {

/// Byte sizes as std::int64_t, so that budgets past 2 GiB do not overflow an int the way
/// `4 << 30` does.
///
/// Example:
///   planner.plan(frugal::MiB(512), sample_batch);
///   frugal::ScopedCpuCap cap(frugal::GiB(4));
constexpr std::int64_t KiB(std::int64_t n) { return n << 10; }
constexpr std::int64_t MiB(std::int64_t n) { return n << 20; }
constexpr std::int64_t GiB(std::int64_t n) { return n << 30; }

/// Formats a byte count with binary units: "512 B", "1.50 KiB", "3.00 MiB", "-2.00 MiB".
std::string format_bytes(std::int64_t bytes);

}  // namespace frugal
