// Step time and activation peak of the residual MLP with and without checkpointing every
// block, interleaved in one process.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "residual_mlp.h"

namespace {

struct Variant : bench::SgdClassifier {
  std::vector<double> activation_peaks;
  std::int64_t allocated_before = 0;
};

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5, steps = 3, threads = 0;
  std::int64_t blocks = 16, width = 512, hidden = 2048, batch = 128;
  CLI::App app{"Checkpointing's cost in time and saving in activation memory"};
  app.add_option("--rounds", rounds)->capture_default_str();
  app.add_option("--steps", steps, "Steps per round and variant")->capture_default_str();
  app.add_option("--blocks", blocks)->capture_default_str();
  app.add_option("--width", width)->capture_default_str();
  app.add_option("--hidden", hidden)->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (0: LibTorch's choice)");
  CLI11_PARSE(app, argc, argv);
  const auto data = bench::counted_random_batch(threads, batch, width);
  auto make = [&](bool checkpointed) {
    Variant v{
        bench::sgd_classifier([&] { return models::make_residual_mlp(blocks, width, hidden, 10); }),
        {},
        0};
    if (checkpointed) {
      v.trainer->add_policy(std::make_shared<frugal::CheckpointPolicy>(
          frugal::CheckpointSelect().types({"ResidualBlock"})));
    }
    v.allocated_before = v.trainer->step(data).memory.allocated;  // warm-up
    return v;
  };
  std::map<std::string, Variant> variants;
  variants.emplace("plain", make(false));
  variants.emplace("checkpointed", make(true));
  auto run = [&](Variant& v) {
    return bench::ms_per_call(
        [&] {
          const auto r = v.trainer->step(data);
          // What the forward keeps for backward, at its high point.
          v.activation_peaks.push_back(static_cast<double>(r.forward_peak - v.allocated_before));
          v.allocated_before = r.memory.allocated;
        },
        steps);
  };
  const auto times =
      bench::interleave({{"plain", [&] { return run(variants.at("plain")); }},
                         {"checkpointed", [&] { return run(variants.at("checkpointed")); }}},
                        rounds);
  const double t_plain = bench::median(times.at("plain"));
  const double t_ckpt = bench::median(times.at("checkpointed"));
  const double a_plain = bench::median(variants.at("plain").activation_peaks);
  const double a_ckpt = bench::median(variants.at("checkpointed").activation_peaks);
  fmt::print(
      "Checkpointing every block: residual MLP {} blocks, width {}, hidden {}, batch {}, "
      "SGD, {} rounds x {} steps, {}\n\n",
      blocks, width, hidden, batch, rounds, steps, bench::machine_line());
  fmt::print("| variant | median step (ms) | activation peak | time ratio | activation ratio |\n");
  fmt::print("|---|---|---|---|---|\n");
  fmt::print("| plain | {:.1f} | {} | 1.00 | 1.0x |\n", t_plain,
             frugal::format_bytes(static_cast<std::int64_t>(a_plain)));
  fmt::print("| checkpointed | {:.1f} | {} | {:.2f} | {:.1f}x smaller |\n\n", t_ckpt,
             frugal::format_bytes(static_cast<std::int64_t>(a_ckpt)), t_ckpt / t_plain,
             a_plain / a_ckpt);
  nlohmann::json j = {{"bench", "checkpoint"},
                      {"plain_ms", t_plain},
                      {"checkpointed_ms", t_ckpt},
                      {"time_ratio", t_ckpt / t_plain},
                      {"plain_activation_bytes", a_plain},
                      {"checkpointed_activation_bytes", a_ckpt},
                      {"activation_ratio", a_plain / a_ckpt}};
  bench::print_json(j);
  return 0;
}
