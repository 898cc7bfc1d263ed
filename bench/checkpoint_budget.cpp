// Checkpointing chosen under a memory budget against checkpointing every block: a chain of
// unequal blocks (dense ones that compute much and keep little, gates that compute little
// and keep much), the budget checkpoint-all's peak plus a slack, the three variants
// (plain, every block, the budgeted choice) interleaved in one process.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "mixed_chain.h"

namespace {

struct Variant : bench::SgdClassifier {
  std::shared_ptr<frugal::CheckpointPolicy> policy;
  std::vector<double> peaks;
};

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7, steps = 5, threads = 0, gate_steps = 6;
  std::int64_t pairs = 6, width = 512, batch = 256;
  double slack = 0.1;
  CLI::App app{"Checkpointing chosen under a budget against checkpointing every block"};
  app.add_option("--rounds", rounds)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "Steps per round and variant")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--pairs", pairs, "(dense, gate) pairs")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--width", width)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--gate-steps", gate_steps, "Elementwise steps of a gate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", batch)->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--slack", slack, "The budget: checkpoint-all's peak times 1 + slack")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--threads", threads, "Intra-op threads (0: LibTorch's choice)");
  CLI11_PARSE(app, argc, argv);
  const auto data = bench::counted_random_batch(threads, batch, width);
  auto make = [&] {
    Variant v{bench::sgd_classifier(
                  [&] { return models::make_mixed_chain(pairs, width, gate_steps, 10); }),
              nullptr,
              {}};
    v.policy = std::make_shared<frugal::CheckpointPolicy>(
        frugal::CheckpointSelect().types({"DenseBlock", "GateBlock"}));
    v.trainer->add_policy(v.policy);
    return v;
  };
  std::map<std::string, Variant> variants;
  variants.emplace("plain", make());
  variants.emplace("every block", make());
  variants.emplace("budgeted", make());
  variants.at("plain").policy->set_enabled(false);
  // The budget from checkpoint-all's measured peak; the budgeted variant plans for it.
  const auto survey =
      frugal::plan_checkpoints(*variants.at("every block").trainer,
                               *variants.at("every block").policy, std::int64_t{1} << 50, data);
  variants.at("every block").policy->set_enabled(true);
  const auto budget =
      static_cast<std::int64_t>(static_cast<double>(survey.all_checkpointed_peak) * (1 + slack));
  const auto plan = frugal::plan_checkpoints(*variants.at("budgeted").trainer,
                                             *variants.at("budgeted").policy, budget, data);
  for (auto& [name, v] : variants) {
    (void)v.trainer->step(data);  // warm-up
  }
  auto run = [&](Variant& v) {
    return bench::ms_per_call(
        [&] { v.peaks.push_back(static_cast<double>(v.trainer->step(data).peak)); }, steps);
  };
  std::vector<std::pair<std::string, std::function<double()>>> order;
  for (const auto* name : {"plain", "every block", "budgeted"}) {
    order.emplace_back(name, [&, name] { return run(variants.at(name)); });
  }
  const auto times = bench::interleave(order, rounds, /*rotate=*/true);
  const double t_all = bench::median(times.at("every block"));
  fmt::print(
      "Checkpointing under a budget: {} (dense, gate) pairs, width {}, gate steps {}, "
      "batch {}, SGD, budget {} (checkpoint-all's peak + {:.0f}%), {} rounds x {} steps, "
      "{}\n\n",
      pairs, width, gate_steps, batch, frugal::format_bytes(budget), slack * 100, rounds, steps,
      bench::machine_line());
  fmt::print("{}\n", plan.table());
  fmt::print(
      "| variant | blocks checkpointed | median step (ms) | step peak | time / every block |\n");
  fmt::print("|---|---|---|---|---|\n");
  nlohmann::json j = {{"bench", "checkpoint_budget"},
                      {"budget", budget},
                      {"fits", plan.fits},
                      {"predicted_peak", plan.predicted_peak},
                      {"threads", torch::get_num_threads()}};
  for (const auto* name : {"plain", "every block", "budgeted"}) {
    const auto& v = variants.at(name);
    const double t = bench::median(times.at(name));
    const auto peak = static_cast<std::int64_t>(bench::median(v.peaks));
    const auto checkpointed = std::string(name) == "plain"         ? std::size_t{0}
                              : std::string(name) == "every block" ? plan.blocks.size()
                                                                   : plan.chosen().size();
    fmt::print("| {} | {} of {} | {:.1f} | {} | {:.3f} |\n", name, checkpointed, plan.blocks.size(),
               t, frugal::format_bytes(peak), t / t_all);
    const std::string key = std::string(name) == "every block" ? "every_block" : name;
    j[key + "_ms"] = t;
    j[key + "_peak"] = peak;
  }
  j["time_ratio"] = bench::median(times.at("budgeted")) / t_all;
  fmt::print("\n{}\n", j.dump());
  return 0;
}
