// The example's one-line progress bar.
#pragma once

#include <fmt/format.h>
#include <frugal/memory/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

namespace fashion {

// A one-line progress bar, redrawn in place on a terminal.
class Progress {
 public:
  Progress(bool enabled, std::int64_t total) : enabled_(enabled), total_(total) {}
  void update(std::int64_t done, double steps_per_s, double loss, std::int64_t allocated,
              std::int64_t peak) {
    if (!enabled_) {
      return;
    }
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * done / std::max<std::int64_t>(total_, 1));
    fmt::print(stderr, "\r[{:<{}}] {}/{} {:.1f} steps/s loss {:.4f} mem {} peak {}  ",
               std::string(filled, '#'), kWidth, done, total_, steps_per_s, loss,
               frugal::format_bytes(allocated), frugal::format_bytes(peak));
    if (done == total_) {
      fmt::print(stderr, "\n");
    }
  }

 private:
  bool enabled_;
  std::int64_t total_;
};

}  // namespace fashion
