// frugal's side of the Python twin (bench/python/twin.py): the residual MLP and the
// Fashion-MNIST CNN, plain, checkpointed and under bf16 autocast; one JSON line each.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <tuple>

#include "bench_util.h"
#include "models.h"
#include "residual_mlp.h"

int main(int argc, char** argv) {
  int steps = 5, threads = 0;
  std::int64_t blocks = 8, width = 256, hidden = 2048, mlp_batch = 256, cnn_batch = 64;
  CLI::App app{"frugal's half of the side-by-side with PyTorch"};
  app.add_option("--steps", steps, "Timed steps per variant")->capture_default_str();
  const std::tuple<const char*, std::int64_t*, const char*> sizes[] = {
      {"--blocks", &blocks, "Residual MLP: blocks"},
      {"--width", &width, "Residual MLP: width"},
      {"--hidden", &hidden, "Residual MLP: hidden width of a block"},
      {"--mlp-batch", &mlp_batch, "Residual MLP: batch"},
      {"--cnn-batch", &cnn_batch, "CNN: batch"}};
  for (const auto& [flag, value, help] : sizes) {
    app.add_option(flag, *value, help)->capture_default_str()->check(CLI::PositiveNumber);
  }
  bench::threads_flag(app, threads, "Intra-op threads (0: LibTorch's choice)");
  CLI11_PARSE(app, argc, argv);
  frugal::CountingAllocator::install();
  for (const std::string model : {"residual_mlp", "cnn"}) {
    for (const std::string variant : {"plain", "checkpoint", "autocast_bf16"}) {
      torch::manual_seed(0);
      const bool mlp = model == "residual_mlp";
      const auto x = mlp ? torch::randn({mlp_batch, width}) : torch::rand({cnn_batch, 1, 28, 28});
      const auto y = torch::randint(0, 10, {x.size(0)}, torch::kLong);
      torch::manual_seed(1);
      auto net =
          mlp ? models::make_residual_mlp(blocks, width, hidden, 10) : fashion::make_cnn(0.0);
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
      nlohmann::json j = {{"side", "frugal"},
                          {"model", model},
                          {"variant", variant},
                          {"step_ms", bench::median(times)},
                          {"peak_bytes", peak},
                          {"loss", loss},
                          {"threads", torch::get_num_threads()},
                          {"batch", x.size(0)},
                          {"blocks", blocks},
                          {"width", width},
                          {"hidden", hidden},
                          {"torch", fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR,
                                                TORCH_VERSION_MINOR, TORCH_VERSION_PATCH)}};
      fmt::print("{}\n", j.dump());
    }
  }
  return 0;
}
