// frugal's side of the Python twin (bench/python/twin.py): the residual MLP and the
// Fashion-MNIST CNN, plain, checkpointed and under bf16 autocast; one JSON line each.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "models.h"
#include "residual_mlp.h"

int main(int argc, char** argv) {
  int steps = 5, threads = 0;
  CLI::App app{"frugal's half of the side-by-side with PyTorch"};
  app.add_option("--steps", steps, "Timed steps per variant")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads (0: LibTorch's choice)");
  CLI11_PARSE(app, argc, argv);
  if (threads > 0) {
    torch::set_num_threads(threads);
  }
  frugal::CountingAllocator::install();
  for (const std::string model : {"residual_mlp", "cnn"}) {
    for (const std::string variant : {"plain", "checkpoint", "autocast_bf16"}) {
      torch::manual_seed(0);
      const bool mlp = model == "residual_mlp";
      const auto x = mlp ? torch::randn({256, 256}) : torch::rand({64, 1, 28, 28});
      const auto y = torch::randint(0, 10, {x.size(0)}, torch::kLong);
      torch::manual_seed(1);
      auto net = mlp ? models::make_residual_mlp(8, 256, 2048, 10) : fashion::make_cnn(0.0);
      torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
      frugal::Trainer trainer(net, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
        return torch::nn::functional::cross_entropy(o.to(torch::kFloat), t);
      });
      if (variant == "checkpoint") {
        // Each name given must be in the model (a misspelt rule is an error): one per model.
        trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
            frugal::CheckpointSelect().types({mlp ? "models::ResidualBlock" : "fashion::Block"})));
      } else if (variant == "autocast_bf16") {
        frugal::use_mixed_precision(trainer, torch::kBFloat16);
      }
      trainer.step({x, y});  // warm-up: optimizer state exists from here
      std::vector<double> times;
      std::int64_t peak = 0;
      double loss = 0;
      for (int i = 0; i < steps; ++i) {
        const auto r = trainer.step({x, y});
        times.push_back(r.time.total_ms);
        peak = std::max(peak, r.peak);
        loss = r.loss;
      }
      nlohmann::json j = {{"side", "frugal"}, {"model", model}, {"variant", variant},
                          {"step_ms", bench::median(times)}, {"peak_bytes", peak},
                          {"loss", loss}, {"threads", torch::get_num_threads()},
                          {"torch", fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR,
                                                TORCH_VERSION_MINOR, TORCH_VERSION_PATCH)}};
      fmt::print("{}\n", j.dump());
    }
  }
  return 0;
}
