// Helpers of the side-by-side benchmarks: interleaved rounds, medians, tables.
#pragma once

#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "main_flags.h"

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

/// The median of each variant's times, by name.
inline std::map<std::string, double> medians(
    const std::map<std::string, std::vector<double>>& times) {
  std::map<std::string, double> out;
  for (const auto& [name, t] : times) {
    out[name] = median(t);
  }
  return out;
}

/// The median over rounds of `name`'s time divided by `base`'s in the same round: a ratio
/// of variants that ran side by side, so that a slow stretch of the machine (which the
/// medians of whole runs still feel when it falls on more rounds of one variant) cancels.
inline double paired_ratio(const std::map<std::string, std::vector<double>>& times,
                           const std::string& name, const std::string& base) {
  const auto& t = times.at(name);
  const auto& b = times.at(base);
  std::vector<double> ratios;
  for (std::size_t r = 0; r < std::min(t.size(), b.size()); ++r) {
    ratios.push_back(t[r] / b[r]);
  }
  return median(ratios);
}

/// A classifier of 10 classes trained by SGD (lr 0.01) on cross-entropy under frugal's
/// Trainer, as the checkpointing benchmarks train theirs.
struct SgdClassifier {
  torch::nn::Sequential net;
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<frugal::Trainer> trainer;
};

/// `net` built under seed 1, in an SgdClassifier.
inline SgdClassifier sgd_classifier(const std::function<torch::nn::Sequential()>& build) {
  SgdClassifier c;
  torch::manual_seed(1);
  c.net = build();
  c.sgd = std::make_unique<torch::optim::SGD>(c.net->parameters(), 0.01);
  c.trainer = std::make_unique<frugal::Trainer>(c.net, *c.sgd,
                                                [](const torch::Tensor& o, const torch::Tensor& t) {
                                                  return torch::nn::functional::cross_entropy(o, t);
                                                });
  return c;
}

/// Sets LibTorch's intra-op threads (0: its choice), installs frugal's counting allocator
/// (before the models, so that their weights are counted) and returns a random batch of
/// `batch` inputs of `width` with labels of 10 classes (seed 0).
inline frugal::Batch counted_random_batch(int threads, std::int64_t batch, std::int64_t width) {
  if (threads > 0) {
    torch::set_num_threads(threads);
  }
  frugal::CountingAllocator::install();
  torch::manual_seed(0);
  return {torch::randn({batch, width}), torch::randint(0, 10, {batch}, torch::kLong)};
}

/// --threads, as the examples take it (main_flags.h).
using examples::threads_flag;

/// The flags of a benchmark of Fashion-MNIST training steps: rounds, steps a round, batch,
/// the model (mlp or cnn) and the intra-op threads.
struct StepFlags {
  int rounds = 15, steps = 50, threads = 0;
  std::int64_t batch = 64;
  std::string model = "mlp";
};

inline void step_flags(CLI::App& app, StepFlags& f) {
  app.add_option("--rounds", f.rounds)->capture_default_str();
  app.add_option("--steps", f.steps, "Steps per round and variant")->capture_default_str();
  app.add_option("--batch", f.batch)->capture_default_str();
  app.add_option("--model", f.model, "mlp or cnn (the Fashion-MNIST models)")
      ->check(CLI::IsMember({"mlp", "cnn"}))
      ->capture_default_str();
  threads_flag(app, f.threads, "Intra-op threads (0: LibTorch's choice)");
}

/// Prints a benchmark's JSON line (the last line of its output, what the benchmark pages are
/// made from), with the intra-op threads it ran with.
inline void print_json(nlohmann::json j) {
  j["threads"] = torch::get_num_threads();
  fmt::print("{}\n", j.dump());
}

inline std::string machine_line() {
  return fmt::format("LibTorch {}.{}.{}, {} intra-op threads", TORCH_VERSION_MAJOR,
                     TORCH_VERSION_MINOR, TORCH_VERSION_PATCH, torch::get_num_threads());
}

}  // namespace bench
