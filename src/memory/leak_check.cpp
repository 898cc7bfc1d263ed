#include "frugal/memory/leak_check.h"

#include <fmt/format.h>

#include <algorithm>

#include "frugal/error.h"
#include "frugal/memory/format.h"

namespace frugal {

LeakCheck::LeakCheck(LeakGuardOptions options) : options_(options) {
  detail::check_at_least(options_.warmup(), 0, "LeakGuard warmup");
  detail::check_at_least(options_.tolerance(), 0, "LeakGuard tolerance");
}

void LeakCheck::observe(std::int64_t allocated, std::int64_t step) {
  ++seen_;
  if (seen_ <= options_.warmup()) {
    return;
  }
  if (baseline_ < 0) {
    baseline_ = allocated;
    return;
  }
  const std::int64_t growth = allocated - baseline_;
  growth_ = std::max(growth_, growth);
  if (growth > options_.tolerance() && options_.throw_on_leak()) {
    throw LeakError(
        fmt::format("frugal: memory leak: after step {} allocated is {}, {} ({} bytes) above "
                    "the baseline of {} taken after step {}; something keeps tensors alive "
                    "across steps (a loss tensor kept for logging?)",
                    step, format_bytes(allocated), format_bytes(growth), growth,
                    format_bytes(baseline_), options_.warmup() + 1),
        growth);
  }
}

}  // namespace frugal
