// The step engine against a hand-written LibTorch loop doing the same work: same model,
// data and seed, interleaved rounds in one process, each round starting one loop later.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "bench_util.h"
#include "models.h"

int main(int argc, char** argv) {
  bench::StepFlags flags;
  bool ledger = true;
  CLI::App app{"Step engine overhead against a hand-written loop"};
  bench::step_flags(app, flags);
  app.add_option("--ledger", ledger, "Measure the ledger in every report")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const int rounds = flags.rounds, steps = flags.steps;
  const std::int64_t batch = flags.batch;
  const std::string model = flags.model;
  frugal::CountingAllocator::install();  // both variants run on the same allocator
  torch::manual_seed(0);
  const auto x = torch::rand({batch, 1, 28, 28});
  const auto y = torch::randint(0, 10, {batch}, torch::kLong);
  auto make = [&] {
    torch::manual_seed(1);
    return model == "cnn" ? fashion::make_cnn(0.0) : fashion::make_mlp(0.0);
  };
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };

  auto hand_model = make();
  torch::optim::Adam hand_adam(hand_model->parameters(), 1e-3);
  double hand_loss = 0;
  // The gradients are dropped after the step, as the Trainer and the Loop drop theirs: the
  // three loops share one process and its allocator, so none keeps its gradients alive
  // while another runs.
  auto hand_step = [&] {
    auto loss = loss_fn(hand_model->forward(x), y);
    loss.backward();
    hand_adam.step();
    hand_loss = loss.item<double>();
    for (auto& p : hand_model->parameters()) {
      p.mutable_grad().reset();
    }
  };

  auto engine_model = make();
  torch::optim::Adam engine_adam(engine_model->parameters(), 1e-3);
  frugal::Trainer trainer(engine_model, engine_adam, loss_fn,
                          frugal::TrainerOptions().ledger(ledger));
  double engine_loss = 0;
  auto engine_step = [&] { engine_loss = trainer.step({x, y}).loss; };

  // The user's own loop under frugal::Loop: the same step as the hand-written one.
  auto loop_model = make();
  torch::optim::Adam loop_adam(loop_model->parameters(), 1e-3);
  frugal::Loop loop(frugal::LoopOptions().ledger(ledger));
  auto& prepared = loop.prepare(loop_model, loop_adam, "model");
  double loop_loss = 0;
  auto loop_step = [&] {
    loop.backward(loss_fn(loop_model->forward(x), y), prepared);
    loop.step(prepared);
    loop_loss = loop.end().models.front().loss;
  };

  hand_step();
  engine_step();
  loop_step();
  // Minor page faults a step of each loop: blocks the allocators hand back to the system
  // are faulted in again by the next step, a cost that shows in the step time.
  std::map<std::string, long> faults;
  auto timed = [&](const char* name, const std::function<void()>& step) {
    return std::function<double()>([&, name, step] {
      rusage before{}, after{};
      getrusage(RUSAGE_SELF, &before);
      const double ms = bench::ms_per_call(step, steps);
      getrusage(RUSAGE_SELF, &after);
      faults[name] += after.ru_minflt - before.ru_minflt;
      return ms;
    });
  };
  const auto times = bench::interleave({{"hand-written", timed("hand-written", hand_step)},
                                        {"frugal::Trainer", timed("frugal::Trainer", engine_step)},
                                        {"frugal::Loop", timed("frugal::Loop", loop_step)}},
                                       rounds, /*rotate=*/true);
  const auto faults_a_step = [&](const char* name) {
    return static_cast<double>(faults.at(name)) / (static_cast<double>(rounds) * steps);
  };
  const auto ms = bench::medians(times);
  const double hand = ms.at("hand-written");
  const double engine = ms.at("frugal::Trainer");
  const double user_loop = ms.at("frugal::Loop");
  const auto ratio = [&](const char* name) {
    return bench::paired_ratio(times, name, "hand-written");
  };
  fmt::print(
      "Engine against a hand-written loop: Fashion-MNIST {}, batch {}, Adam, {} rounds x {} "
      "steps, {}; the loops at loss {:.6f} / {:.6f} / {:.6f}\n\n",
      model, batch, rounds, steps, bench::machine_line(), hand_loss, engine_loss, loop_loss);
  fmt::print(
      "| loop | median step (ms) | ratio (median of the rounds' ratios) | page faults a step "
      "|\n|---|---|---|---|\n");
  for (const auto& [key, label] :
       {std::pair<const char*, const char*>{"hand-written", "hand-written"},
        {"frugal::Trainer", "frugal::Trainer (probe + ledger every step)"},
        {"frugal::Loop", "frugal::Loop (backward, step, end; probe + ledger)"}}) {
    fmt::print("| {} | {:.3f} | {:.3f} | {:.0f} |\n", label, ms.at(key), ratio(key),
               faults_a_step(key));
  }
  fmt::print("\n");
  nlohmann::json j = {{"bench", "engine_overhead"},
                      {"model", model},
                      {"hand_ms", hand},
                      {"engine_ms", engine},
                      {"ratio", ratio("frugal::Trainer")},
                      {"loop_ms", user_loop},
                      {"loop_ratio", ratio("frugal::Loop")},
                      {"hand_faults", faults_a_step("hand-written")},
                      {"engine_faults", faults_a_step("frugal::Trainer")},
                      {"loop_faults", faults_a_step("frugal::Loop")}};
  bench::print_json(j);
  return 0;
}
