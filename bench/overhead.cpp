// frugal's own cost per step where a step is small: MLPs of a few thousand weights and
// batches of 1 to 32 samples (reinforcement learning, control, tabular data), where the
// kernels take microseconds and anything the engine adds shows. Four loops do the same
// work on the same model, data and seed, interleaved round by round in one process:
//   hand-written     zero (set_to_none), forward, loss, backward, Adam step, loss.item()
//   Trainer          frugal::Trainer with no policy (probe and ledger in every report)
//   Trainer, no ledger   the same with TrainerOptions().ledger(false)
//   Trainer + policies   clipping by norm, a cosine schedule with warm-up, a leak guard
// Each with LibTorch's Adam (a loop over parameters, ops per parameter) and, on LibTorch 2.4
// and later, Adam through the fused kernel (at::_fused_adam_, what PyTorch-Python's
// Adam(fused=True) runs). bench/python/overhead_twin.py runs this binary beside the same
// loops in PyTorch-Python. Rounds are short (20 steps) and many: on a shared machine a slow
// spell then falls on every loop alike. `--only LOOP` runs one loop alone, for a profiler or
// for counting instructions a step with callgrind (two runs of different lengths).
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench_util.h"
#include "fused_adam.h"

namespace {

struct Shape {
  std::string name;
  std::int64_t inputs, hidden, outputs;
  bool classes() const { return outputs > 1; }  // cross-entropy on classes, else MSE
};

Shape parse_shape(const std::string& text) {
  Shape s{text, 0, 0, 0};
  char dash1 = 0, dash2 = 0;
  std::istringstream in(text);
  in >> s.inputs >> dash1 >> s.hidden >> dash2 >> s.outputs;
  if (!in || dash1 != '-' || dash2 != '-' || s.inputs < 1 || s.hidden < 1 || s.outputs < 1 ||
      in.peek() != std::char_traits<char>::eof()) {
    throw CLI::ValidationError("--models",
                               "'" + text + "' is not INPUTS-HIDDEN-OUTPUTS (e.g. 32-64-1)");
  }
  return s;
}

torch::nn::Sequential make_mlp(const Shape& s) {
  torch::manual_seed(1);
  return torch::nn::Sequential(torch::nn::Linear(s.inputs, s.hidden), torch::nn::ReLU(),
                               torch::nn::Linear(s.hidden, s.outputs));
}

torch::Tensor loss_of(const Shape& s, const torch::Tensor& out, const torch::Tensor& y) {
  return s.classes() ? torch::nn::functional::cross_entropy(out, y)
                     : torch::nn::functional::mse_loss(out, y);
}

// A pool of batches the loops cycle through, so that the loss does not fall to nothing on
// one memorised batch (gradients and Adam's moments near zero run slower, denormal, kernels).
struct Data {
  std::vector<torch::Tensor> x, y;
  std::size_t next = 0;
  std::size_t take() { return next++ % x.size(); }
};

Data make_data(const Shape& s, std::int64_t batch, int count) {
  torch::manual_seed(0);
  Data d;
  for (int i = 0; i < count; ++i) {
    d.x.push_back(torch::randn({batch, s.inputs}));
    d.y.push_back(s.classes() ? torch::randint(0, s.outputs, {batch}, torch::kLong)
                              : torch::randn({batch, s.outputs}));
  }
  return d;
}

// One model, optimizer and step function per loop; the step returns the loss it logged.
struct Loop {
  std::string name;
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Optimizer> adam;
  std::unique_ptr<frugal::Trainer> trainer;
  std::function<double()> step;
  double loss = 0;
  Data data;
};

std::unique_ptr<torch::optim::Optimizer> make_adam(const std::string& kind,
                                                   std::vector<torch::Tensor> params) {
  const auto options = torch::optim::AdamOptions(1e-3);
#if FRUGAL_BENCH_HAS_FUSED_ADAM
  if (kind == "fused") {
    return std::make_unique<bench::FusedAdam>(std::move(params), options);
  }
#endif
  TORCH_CHECK(kind == "adam", "--optimizers: '", kind, "' is not one of adam, fused");
  return std::make_unique<torch::optim::Adam>(std::move(params), options);
}

std::vector<Loop> make_loops(const Shape& s, std::int64_t batch, const std::string& adam,
                             int steps_in_all) {
  auto loss_fn = [s](const torch::Tensor& out, const torch::Tensor& t) {
    return loss_of(s, out, t);
  };
  std::vector<Loop> loops(4);
  const char* names[] = {"hand-written", "frugal::Trainer", "frugal::Trainer, no ledger",
                         "frugal::Trainer + clip, schedule, leak guard"};
  for (std::size_t i = 0; i < loops.size(); ++i) {
    auto& l = loops[i];
    l.name = names[i];
    l.model = make_mlp(s);
    l.data = make_data(s, batch, 256);  // each loop sees the same batches in the same order
    l.adam = make_adam(adam, l.model->parameters());
    if (i == 0) {
      l.step = [&l, s] {
        const auto i = l.data.take();
        const auto& x = l.data.x[i];
        const auto& y = l.data.y[i];
        for (auto& group : l.adam->param_groups()) {  // zero_grad(set_to_none) on any LibTorch
          for (auto& p : group.params()) {
            p.mutable_grad().reset();
          }
        }
        auto loss = loss_of(s, l.model->forward(x), y);
        loss.backward();
        l.adam->step();
        return loss.item<double>();
      };
      continue;
    }
    l.trainer = std::make_unique<frugal::Trainer>(l.model, *l.adam, loss_fn,
                                                  frugal::TrainerOptions().ledger(i != 2));
    if (i == 3) {
      l.trainer->add_policy(
          std::make_shared<frugal::ClipGrad>(frugal::ClipGradOptions().max_norm(1.0)));
      l.trainer->add_policy(std::make_shared<frugal::LrSchedule>(frugal::LrScheduleOptions()
                                                                     .decay(frugal::LrDecay::Cosine)
                                                                     .warmup_steps(10)
                                                                     .total_steps(steps_in_all)));
      l.trainer->add_policy(std::make_shared<frugal::LeakGuard>());
    }
    l.step = [&l] {
      const auto i = l.data.take();
      return l.trainer->step({l.data.x[i], l.data.y[i]}).loss;
    };
  }
  return loops;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 101, steps = 20, threads = 1;  // short rounds: a slow spell hits every loop alike
  std::vector<std::string> models = {"32-64-1", "784-128-10"};
  std::vector<std::int64_t> batches = {1, 8, 32};
  std::vector<std::string> optimizers = {"adam"};
#if FRUGAL_BENCH_HAS_FUSED_ADAM
  optimizers.push_back("fused");
#endif
  CLI::App app{"frugal's cost per step on overhead-bound MLP training"};
  app.add_option("--rounds", rounds, "Interleaved rounds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps", steps, "Steps per round and loop")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--models", models, "MLP shapes INPUTS-HIDDEN-OUTPUTS (1 output: MSE)")
      ->capture_default_str();
  app.add_option("--batches", batches, "Batch sizes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--optimizers", optimizers,
                 "adam (LibTorch's), fused (at::_fused_adam_, LibTorch 2.4 and later)")
      ->check(CLI::IsMember({"adam", "fused"}))
      ->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  std::string only;
  const std::vector<std::string> loop_keys = {"hand", "trainer", "no-ledger", "policies"};
  app.add_option("--only", only,
                 "Run one loop alone, rounds x steps steps, for a profiler or callgrind: hand, "
                 "trainer, no-ledger or policies")
      ->check(CLI::IsMember(loop_keys));
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  frugal::CountingAllocator::install();  // every loop runs on the same allocator

  fmt::print(
      "Per-step cost on small MLPs, Adam 1e-3, {} rounds x {} steps, {}; medians of "
      "the rounds, in microseconds a step\n\n",
      rounds, steps, bench::machine_line());
  fmt::print("{}", only.empty()
                       ? "| model | batch | Adam | hand-written | Trainer | x | frugal's own | "
                         "no ledger | x | + policies | x |\n|---|---|---|---|---|---|---|---|"
                         "---|---|---|\n"
                       : "| model | batch | Adam | loop | alone |\n|---|---|---|---|---|\n");
  std::vector<nlohmann::json> rows;
  for (const auto& adam : optimizers) {
    for (const auto& text : models) {
      const Shape s = parse_shape(text);
      for (const auto batch : batches) {
        auto loops = make_loops(s, batch, adam, rounds * steps + 10);
        if (!only.empty()) {
          const auto at = std::find(loop_keys.begin(), loop_keys.end(), only) - loop_keys.begin();
          auto& l = loops.at(static_cast<std::size_t>(at));
          for (int i = 0; i < 10; ++i) {
            l.loss = l.step();
          }
          const double us = 1e3 * bench::ms_per_call([&l] { l.loss = l.step(); }, rounds * steps);
          fmt::print("| {} | {} | {} | {} | {:.1f} |\n", s.name, batch, adam, l.name, us);
          rows.push_back({{"model", s.name},
                          {"batch", batch},
                          {"optimizer", adam},
                          {"loop", only},
                          {"alone_us", us},
                          {"loss", l.loss}});
          continue;
        }
        std::vector<std::pair<std::string, std::function<double()>>> variants;
        for (auto& l : loops) {
          for (int i = 0; i < 10; ++i) {
            l.loss = l.step();  // warm-up: Adam's state exists, caches are filled
          }
          variants.emplace_back(l.name, [&l, steps] {
            return 1e3 * bench::ms_per_call([&l] { l.loss = l.step(); }, steps);
          });
        }
        const auto times = bench::interleave(variants, rounds, /*rotate=*/true);
        std::vector<double> us;
        for (const auto& l : loops) {
          us.push_back(bench::median(times.at(l.name)));
        }
        fmt::print(
            "| {} | {} | {} | {:.1f} | {:.1f} | {:.3f} | {:.1f} | {:.1f} | {:.3f} | {:.1f} | "
            "{:.3f} |\n",
            s.name, batch, adam, us[0], us[1], us[1] / us[0], us[1] - us[0], us[2], us[2] / us[0],
            us[3], us[3] / us[0]);
        rows.push_back({{"model", s.name},
                        {"batch", batch},
                        {"optimizer", adam},
                        {"hand_us", us[0]},
                        {"trainer_us", us[1]},
                        {"trainer_no_ledger_us", us[2]},
                        {"trainer_policies_us", us[3]},
                        {"ratio", us[1] / us[0]},
                        {"own_us", us[1] - us[0]},
                        {"losses", {loops[0].loss, loops[1].loss, loops[2].loss}}});
      }
    }
  }
  const nlohmann::json j = {{"bench", "overhead"}, {"machine", bench::machine_line()},
                            {"threads", threads},  {"rounds", rounds},
                            {"steps", steps},      {"rows", rows}};
  fmt::print("\n{}\n", j.dump());
  return 0;
}
