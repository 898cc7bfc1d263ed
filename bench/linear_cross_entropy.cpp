// A language model's head over a large vocabulary: linear + cross_entropy on the whole
// [tokens, classes] logits against frugal::nn::linear_cross_entropy chunk by chunk, forward
// and backward, interleaved round by round: the time of each, and the peak above the resting
// bytes as the probe measures it.
//
//   bench_linear_cross_entropy --tokens 4096 --width 256 --classes 16384 --chunk 1024
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"

namespace {

namespace F = torch::nn::functional;

struct Args {
  std::int64_t tokens = 4096, width = 256, classes = 16384, chunk = 1024;
  int rounds = 5, calls = 3, threads = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"linear + cross_entropy: whole logits against frugal::nn::linear_cross_entropy"};
  app.add_option("--tokens", a.tokens, "tokens in the batch")->check(CLI::PositiveNumber);
  app.add_option("--width", a.width, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--classes", a.classes, "vocabulary size")->check(CLI::PositiveNumber);
  app.add_option("--chunk", a.chunk, "tokens per chunk")->check(CLI::PositiveNumber);
  app.add_option("--rounds", a.rounds, "interleaved rounds")->check(CLI::PositiveNumber);
  app.add_option("--calls", a.calls, "forward+backward calls per round")
      ->check(CLI::PositiveNumber);
  bench::threads_flag(app, a.threads, "LibTorch threads (0: its default)");
  CLI11_PARSE(app, argc, argv);
  const frugal::MemoryProbe probe(torch::kCPU, frugal::MemoryScope::Thread);
  torch::manual_seed(0);
  auto hidden = torch::randn({a.tokens, a.width}).requires_grad_(true);
  auto weight = (torch::randn({a.classes, a.width}) * 0.05).requires_grad_(true);
  auto bias = torch::zeros({a.classes}).requires_grad_(true);
  const auto targets = torch::randint(a.classes, {a.tokens});
  auto release = [&] {
    for (auto* t : {&hidden, &weight, &bias}) {
      t->mutable_grad().reset();
    }
  };
  const std::function<torch::Tensor()> plain = [&] {
    return F::cross_entropy(F::linear(hidden, weight, bias), targets);
  };
  const std::function<torch::Tensor()> chunked = [&] {
    return frugal::nn::linear_cross_entropy(hidden, weight, bias, targets,
                                            frugal::nn::LinearCrossEntropyOptions().chunk(a.chunk));
  };
  const std::function<torch::Tensor()> recomputed = [&] {
    return frugal::nn::linear_cross_entropy(
        hidden, weight, bias, targets,
        frugal::nn::LinearCrossEntropyOptions().chunk(a.chunk).recompute(true));
  };
  std::map<std::string, std::int64_t> peaks;
  auto timed = [&](const std::string& name, const std::function<torch::Tensor()>& loss) {
    return [&, name, loss] {
      const double ms = bench::ms_per_call(
          [&] {
            frugal::ScopedPeak region(probe);
            const auto resting = probe.allocated();
            loss().backward();
            release();
            peaks[name] = std::max(peaks[name], region.end() - resting);
          },
          a.calls);
      return ms;
    };
  };
  // One warm-up call each, then the rounds.
  timed("plain", plain)();
  timed("chunked", chunked)();
  timed("recomputed", recomputed)();
  const auto times = bench::interleave({{"plain", timed("plain", plain)},
                                        {"chunked", timed("chunked", chunked)},
                                        {"recomputed", timed("recomputed", recomputed)}},
                                       a.rounds, true);
  const double plain_ms = bench::median(times.at("plain"));
  const double chunked_ms = bench::median(times.at("chunked"));
  const double recomputed_ms = bench::median(times.at("recomputed"));
  const std::int64_t logits_bytes = a.tokens * a.classes * 4;
  const double saved =
      static_cast<double>(peaks["plain"] - peaks["chunked"]) / (2.0 * logits_bytes);
  fmt::print("{} tokens x {} classes, width {}, chunk {}; {}; medians of {} rounds of {} calls\n\n",
             a.tokens, a.classes, a.width, a.chunk, bench::machine_line(), a.rounds, a.calls);
  fmt::print(
      "| head | forward + backward (ms) | x | peak above resting | x |\n|---|---|---|---|---|\n");
  fmt::print("| linear + cross_entropy | {:.1f} | 1.00 | {} | 1.00 |\n", plain_ms,
             frugal::format_bytes(peaks["plain"]));
  fmt::print("| nn::linear_cross_entropy | {:.1f} | {:.2f} | {} | {:.2f} |\n", chunked_ms,
             chunked_ms / plain_ms, frugal::format_bytes(peaks["chunked"]),
             static_cast<double>(peaks["chunked"]) / static_cast<double>(peaks["plain"]));
  fmt::print("| nn::linear_cross_entropy, recompute | {:.1f} | {:.2f} | {} | {:.2f} |\n\n",
             recomputed_ms, recomputed_ms / plain_ms, frugal::format_bytes(peaks["recomputed"]),
             static_cast<double>(peaks["recomputed"]) / static_cast<double>(peaks["plain"]));
  fmt::print("the logits and their gradient: {}; the chunked peak is lower by {:.0f} % of that\n",
             frugal::format_bytes(2 * logits_bytes), 100 * saved);
  nlohmann::json j = {{"plain_ms", plain_ms},
                      {"chunked_ms", chunked_ms},
                      {"time_ratio", chunked_ms / plain_ms},
                      {"plain_peak", peaks["plain"]},
                      {"chunked_peak", peaks["chunked"]},
                      {"logits_and_gradient_bytes", 2 * logits_bytes},
                      {"saved_fraction", saved},
                      {"recomputed_ms", recomputed_ms},
                      {"recomputed_peak", peaks["recomputed"]}};
  fmt::print("{}\n", j.dump());
  return 0;
}
