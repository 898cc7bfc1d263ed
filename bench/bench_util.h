// Helpers of the side-by-side benchmarks: interleaved rounds, medians, tables.
#pragma once

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

/// Milliseconds per call of `fn`, timed over `calls` calls.
inline double ms_per_call(const std::function<void()>& fn, int calls) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) {
    fn();
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
             .count() /
         calls;
}

/// Runs each variant once per round, in turn, for `rounds` rounds; returns each variant's
/// per-round times. Interleaving spreads the machine's noise over all variants alike;
/// `rotate` starts each round one variant later, so that no variant always runs first
/// (on caches the one before it left) or right after the same neighbour.
inline std::map<std::string, std::vector<double>> interleave(
    const std::vector<std::pair<std::string, std::function<double()>>>& variants, int rounds,
    bool rotate = false) {
  std::map<std::string, std::vector<double>> times;
  const auto n = variants.size();
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      const auto& [name, run] = variants[rotate ? (i + static_cast<std::size_t>(r)) % n : i];
      times[name].push_back(run());
    }
  }
  return times;
}

inline std::string machine_line() {
  return fmt::format("LibTorch {}.{}.{}, {} intra-op threads", TORCH_VERSION_MAJOR,
                     TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, torch::get_num_threads());
}

}  // namespace bench
