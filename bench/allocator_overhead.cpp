// The counting CPU allocator's cost on training steps of a small MLP, against LibTorch's
// default allocator, interleaved in one process.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"

int main(int argc, char** argv) {
  int rounds = 15;
  int steps = 100;
  int threads = 0;
  std::int64_t batch = 64;
  CLI::App app{"Counting allocator overhead on MLP training steps"};
  app.add_option("--rounds", rounds, "Interleaved rounds")->capture_default_str();
  app.add_option("--steps", steps, "Training steps per round and variant")->capture_default_str();
  app.add_option("--batch", batch, "Samples per step")->capture_default_str();
  bench::threads_flag(app, threads, "Intra-op threads (0: LibTorch's choice)");
  CLI11_PARSE(app, argc, argv);

  torch::manual_seed(0);
  torch::nn::Sequential mlp(torch::nn::Linear(784, 512), torch::nn::ReLU(),
                            torch::nn::Linear(512, 256), torch::nn::ReLU(),
                            torch::nn::Linear(256, 10));
  torch::optim::SGD sgd(mlp->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  const auto x = torch::randn({batch, 784});
  const auto y = torch::randint(0, 10, {batch}, torch::kLong);
  auto train_steps = [&] {
    return bench::ms_per_call(
        [&] {
          sgd.zero_grad();
          torch::nn::functional::cross_entropy(mlp->forward(x), y).backward();
          sgd.step();
        },
        steps);
  };
  train_steps();  // warm-up
  const auto times = bench::interleave({{"default",
                                         [&] {
                                           frugal::CountingAllocator::uninstall();
                                           return train_steps();
                                         }},
                                        {"counting",
                                         [&] {
                                           frugal::CountingAllocator::install();
                                           return train_steps();
                                         }}},
                                       rounds);
  frugal::CountingAllocator::uninstall();

  const double base = bench::median(times.at("default"));
  const double counted = bench::median(times.at("counting"));
  fmt::print(
      "Counting allocator overhead: MLP 784-512-256-10, batch {}, SGD, {} rounds x {} "
      "steps, {}\n\n",
      batch, rounds, steps, bench::machine_line());
  fmt::print("| allocator | median step (ms) | ratio |\n|---|---|---|\n");
  fmt::print("| default | {:.3f} | 1.000 |\n", base);
  fmt::print("| counting | {:.3f} | {:.3f} |\n\n", counted, counted / base);
  nlohmann::json j = {
      {"bench", "allocator_overhead"}, {"default_ms", base}, {"counting_ms", counted},
      {"ratio", counted / base},       {"rounds", rounds},   {"steps", steps}};
  bench::print_json(j);
  return 0;
}
