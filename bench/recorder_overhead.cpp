// The memory recorder's cost on a training step: the Fashion-MNIST CNN's Trainer step with
// no MemoryTimeline, with one whose steps are still to come (recording off: the hooks that
// are always there, one atomic load an allocation), and with a MemoryRecorder recording
// every step (on), interleaved in one process.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "models.h"

namespace {

struct Setup {
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Adam> adam;
  std::unique_ptr<frugal::Trainer> trainer;
};

Setup make(const std::string& which) {
  Setup s;
  torch::manual_seed(1);
  s.model = which == "cnn" ? fashion::make_cnn(0.0) : fashion::make_mlp(0.0);
  s.adam = std::make_unique<torch::optim::Adam>(s.model->parameters(), 1e-3);
  s.trainer = std::make_unique<frugal::Trainer>(
      s.model, *s.adam, [](const torch::Tensor& out, const torch::Tensor& t) {
        return torch::nn::functional::cross_entropy(out, t);
      });
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  bench::StepFlags flags;
  flags.steps = 30;
  flags.model = "cnn";
  CLI::App app{"The memory recorder's cost on a Trainer step"};
  bench::step_flags(app, flags);
  CLI11_PARSE(app, argc, argv);
  const int rounds = flags.rounds, steps = flags.steps;
  const std::int64_t batch = flags.batch;
  const std::string model = flags.model;
  torch::manual_seed(0);
  const frugal::Batch data{torch::rand({batch, 1, 28, 28}), torch::randint(0, 10, {batch})};

  auto plain = make(model);
  auto off = make(model);
  off.trainer->add_policy(std::make_shared<frugal::MemoryTimeline>(
      "never.html", std::numeric_limits<std::int64_t>::max()));
  auto on = make(model);
  std::int64_t events = 0;
  for (auto* s : {&plain, &off, &on}) {
    s->trainer->step(data);
  }
  const auto times = bench::interleave(
      {{"no recorder",
        [&] { return bench::ms_per_call([&] { plain.trainer->step(data); }, steps); }},
       {"recording off",
        [&] { return bench::ms_per_call([&] { off.trainer->step(data); }, steps); }},
       {"recording on",
        [&] {
          frugal::MemoryRecorder recorder;
          recorder.watch(*on.model, on.adam.get());
          const auto ms = bench::ms_per_call([&] { on.trainer->step(data); }, steps);
          events = recorder.events() + recorder.dropped();
          return ms;
        }}},
      rounds, /*rotate=*/true);
  const auto ms = bench::medians(times);
  const auto ratio = [&](const char* name) {
    return bench::paired_ratio(times, name, "no recorder");
  };
  fmt::print(
      "Memory recorder on a Trainer step: Fashion-MNIST {}, batch {}, Adam, {} rounds x {} "
      "steps, {}; {:.0f} allocations and frees a step recorded\n\n",
      model, batch, rounds, steps, bench::machine_line(), static_cast<double>(events) / steps);
  fmt::print("| step | median (ms) | ratio (median of the rounds' ratios) |\n|---|---|---|\n");
  for (const auto* name : {"no recorder", "recording off", "recording on"}) {
    fmt::print("| {} | {:.3f} | {:.3f} |\n", name, ms.at(name), ratio(name));
  }
  fmt::print("\n");
  bench::print_json({{"bench", "recorder_overhead"},
                     {"model", model},
                     {"plain_ms", ms.at("no recorder")},
                     {"off_ratio", ratio("recording off")},
                     {"on_ratio", ratio("recording on")},
                     {"events_a_step", static_cast<double>(events) / steps}});
  return 0;
}
