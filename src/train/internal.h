// Small helpers shared by the trainer's source files.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <chrono>
#include <cstdint>

namespace frugal::detail {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

inline void check_positive(const c10::optional<std::int64_t>& value, const char* name) {
  TORCH_CHECK(!value.has_value() || *value >= 1, "frugal: ", name, " must be >= 1, got ",
              *value);
}

}  // namespace frugal::detail
