// The bytes of each category over a recording's events: what the HTML page and the PNG draw.
#pragma once

#include <array>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "recorder_impl.h"

namespace frugal::detail {

/// MemoryCategory's values.
inline constexpr std::size_t kCategories = 6;

/// The names (name_memory) that have a column of their own; the rest stay in `Other`.
inline constexpr std::size_t kNamed = 4;

struct TimelinePoint {
  std::size_t event = 0;                          // index into Recording::events
  std::array<std::int64_t, kCategories> bytes{};  // by MemoryCategory, after the event
  std::array<std::int64_t, kNamed> named{};       // the first names' bytes, part of `Other`
  std::int64_t total() const {
    return std::accumulate(bytes.begin(), bytes.end(), std::int64_t{0});
  }
};

/// One point after each kept event; the totals are the process's allocated bytes.
std::vector<TimelinePoint> timeline_points(const Recording& recording);
/// At most `most` points, each the highest of its run (the peak is kept).
std::vector<TimelinePoint> thin(const std::vector<TimelinePoint>& points, std::size_t most);

/// The page around the data: its head and style, and the script that draws DATA.
const char* timeline_page_head();
const char* timeline_page_script();

}  // namespace frugal::detail
