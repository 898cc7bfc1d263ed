// frugal's in-place Adam, 8-bit and 4-bit Adam (also with factored second moments) and Adam
// on bfloat16 weights (stochastic rounding) against LibTorch's Adam, and the whole step with the
// optimizer step in backward against the ordinary one, side by side, on the Fashion-MNIST CNN
// (batch 64).
//
//   bench_optimizer --rounds 15 --calls 10 --threads 2
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "models.h"

namespace {

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

// An optimizer over the CNN's parameters, with gradients set once, ready to be stepped.
struct Stepper {
  torch::nn::Sequential model;
  std::unique_ptr<frugal::nn::Int8Weights> int8;  // the model's matrices, in 8 bits
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

// `make` builds the optimizer over the parameters; `dtype` is the weights' (and gradients');
// `int8`: the model is one unit of an Int8Weights (its matrices in 8 bits, the rest bf16).
template <typename Make>
Stepper make_stepper(Make make, torch::Dtype dtype = torch::kFloat32, bool int8 = false) {
  torch::manual_seed(0);
  Stepper s{fashion::make_cnn(0.0), nullptr, nullptr};
  s.model->to(dtype);
  if (int8) {
    s.int8 = std::make_unique<frugal::nn::Int8Weights>(
        frugal::nn::Int8WeightsOptions().dtype(torch::kBFloat16));
    s.int8->add(s.model);
  }
  {
    std::unique_ptr<frugal::nn::Int8Weights::Materialised> shaped;  // stored ones: their shape
    if (int8) {
      shaped = std::make_unique<frugal::nn::Int8Weights::Materialised>(*s.int8);
    }
    for (auto& p : s.model->parameters()) {
      p.mutable_grad() = torch::randn_like(p) * 1e-3;
    }
  }
  s.optimizer = make(s.model->parameters());
  s.optimizer->step();  // the state exists: what is timed is the steady step
  return s;
}

template <typename Adam>
Stepper make_stepper() {
  return make_stepper([](std::vector<torch::Tensor> params) {
    return std::make_unique<Adam>(std::move(params), torch::optim::AdamOptions(1e-4));
  });
}

// A trainer on the CNN with frugal's Adam, with or without the step in backward.
struct Training {
  torch::nn::Sequential model;
  std::unique_ptr<frugal::optim::Adam> adam;
  std::unique_ptr<frugal::Trainer> trainer;
};

Training make_training(bool in_backward) {
  torch::manual_seed(0);
  Training t{fashion::make_cnn(0.0), nullptr, nullptr};
  t.adam =
      std::make_unique<frugal::optim::Adam>(t.model->parameters(), torch::optim::AdamOptions(1e-4));
  t.trainer = std::make_unique<frugal::Trainer>(t.model, *t.adam, cross_entropy);
  if (in_backward) {
    t.trainer->add_policy(std::make_shared<frugal::StepInBackward>());
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 15, calls = 10, threads = 2;
  CLI::App app{"frugal's optimizer step and the step in backward, side by side"};
  app.add_option("--rounds", rounds, "Interleaved rounds")->check(CLI::Range(1, 1000));
  app.add_option("--calls", calls, "Calls per round")->check(CLI::Range(1, 10000));
  app.add_option("--threads", threads, "Intra-op threads")->check(CLI::Range(1, 256));
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  frugal::CountingAllocator::install();

  // Each optimizer step against LibTorch's Adam on float32 weights (the first row).
  const auto adam8bit = [](frugal::optim::QuantizedStateOptions states) {
    return [states](std::vector<torch::Tensor> params) {
      return std::make_unique<frugal::optim::Adam8bit>(std::move(params),
                                                       torch::optim::AdamOptions(1e-4), states);
    };
  };
  const auto four_bit = frugal::optim::four_bit_states();
  struct Row {
    std::string key, label;
    Stepper stepper;
  };
  std::vector<Row> rows;
  rows.push_back({"libtorch_adam", "LibTorch's Adam", make_stepper<torch::optim::Adam>()});
  rows.push_back({"adam", "Adam step (state exists)", make_stepper<frugal::optim::Adam>()});
  rows.push_back({"adam8bit", "Adam8bit step (8-bit states) vs LibTorch's Adam",
                  make_stepper<frugal::optim::Adam8bit>()});
  rows.push_back({"adam8bit_factored", "Adam8bit, factored second moments, vs LibTorch's Adam",
                  make_stepper(adam8bit(frugal::optim::QuantizedStateOptions().factored(true)))});
  rows.push_back({"adam_bf16_weights",
                  "Adam on bf16 weights (stochastic rounding) vs LibTorch's Adam (float32)",
                  make_stepper(
                      [](std::vector<torch::Tensor> params) {
                        return std::make_unique<frugal::optim::Adam>(
                            std::move(params), torch::optim::AdamOptions(1e-4));
                      },
                      torch::kBFloat16)});
  rows.push_back({"adam8bit_bf16_weights",
                  "Adam8bit on bf16 weights (stochastic rounding) vs LibTorch's Adam (float32)",
                  make_stepper(adam8bit({}), torch::kBFloat16)});
  rows.push_back({"adam_int8_weights",
                  "Adam on 8-bit weights (stochastic rounding) vs LibTorch's Adam (float32)",
                  make_stepper(
                      [](std::vector<torch::Tensor> params) {
                        return std::make_unique<frugal::optim::Adam>(
                            std::move(params), torch::optim::AdamOptions(1e-4));
                      },
                      torch::kBFloat16, true)});
  rows.push_back({"adam8bit_int8_weights",
                  "Adam8bit on 8-bit weights (stochastic rounding) vs LibTorch's Adam (float32)",
                  make_stepper(adam8bit({}), torch::kBFloat16, true)});
  rows.push_back({"adam4bit", "Adam4bit step (4-bit states, blocks of 128) vs LibTorch's Adam",
                  make_stepper(adam8bit(four_bit))});
  rows.push_back({"adam4bit_factored", "Adam4bit, factored second moments, vs LibTorch's Adam",
                  make_stepper(adam8bit(frugal::optim::four_bit_states().factored(true)))});
  rows.push_back({"adam4bit_bf16_weights",
                  "Adam4bit on bf16 weights (stochastic rounding) vs LibTorch's Adam (float32)",
                  make_stepper(adam8bit(four_bit), torch::kBFloat16)});
  std::vector<std::pair<std::string, std::function<double()>>> variants;
  for (auto& row : rows) {
    auto* optimizer = row.stepper.optimizer.get();
    variants.emplace_back(row.key, [optimizer, calls] {
      return bench::ms_per_call([&] { optimizer->step(); }, calls);
    });
  }
  const auto steps = bench::interleave(variants, rounds);

  torch::manual_seed(1);
  const frugal::Batch batch{torch::randn({64, 1, 28, 28}), torch::randint(0, 10, {64})};
  auto ordinary = make_training(false);
  auto fused = make_training(true);
  const auto whole = bench::interleave(
      {{"ordinary step",
        [&] { return bench::ms_per_call([&] { ordinary.trainer->step(batch); }, calls); }},
       {"step in backward",
        [&] { return bench::ms_per_call([&] { fused.trainer->step(batch); }, calls); }}},
      rounds);

  const double torch_ms = bench::median(steps.at("libtorch_adam"));
  const auto whole_ms = bench::medians(whole);
  const double plain_ms = whole_ms.at("ordinary step");
  const double fused_ms = whole_ms.at("step in backward");
  fmt::print(
      "bench_optimizer: Fashion-MNIST CNN (3.27 M parameters), batch 64, {} rounds of {} "
      "calls, medians; {}\n\n",
      rounds, calls, bench::machine_line());
  fmt::print("| what | LibTorch / ordinary (ms) | frugal (ms) | ratio |\n|---|---|---|---|\n");
  nlohmann::json table = nlohmann::json::array();
  for (std::size_t r = 1; r < rows.size(); ++r) {
    const double ms = bench::median(steps.at(rows[r].key));
    fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} |\n", rows[r].label, torch_ms, ms, ms / torch_ms);
    table.push_back({{"what", rows[r].key}, {"libtorch_ms", torch_ms}, {"frugal_ms", ms}});
  }
  // 8-bit weights against bfloat16 ones, the same states (after the rows above in the JSON).
  nlohmann::json ratios = nlohmann::json::array();
  for (const auto& [int8, bf16, label] :
       {std::tuple<const char*, const char*, const char*>{"adam_int8_weights", "adam_bf16_weights",
                                                          "Adam: 8-bit weights vs bf16 weights"},
        {"adam8bit_int8_weights", "adam8bit_bf16_weights",
         "Adam8bit: 8-bit weights vs bf16 weights"}}) {
    const double a = bench::median(steps.at(bf16)), b = bench::median(steps.at(int8));
    fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} |\n", label, a, b, b / a);
    ratios.push_back({{"what", std::string(int8) + "_vs_bf16"}, {"bf16_ms", a}, {"int8_ms", b}});
  }
  fmt::print("| whole step, frugal Adam: ordinary vs in backward | {:.2f} | {:.2f} | {:.2f} |\n",
             plain_ms, fused_ms, fused_ms / plain_ms);
  table.push_back(
      {{"what", "step_in_backward"}, {"ordinary_ms", plain_ms}, {"in_backward_ms", fused_ms}});
  for (auto& row : ratios) {
    table.push_back(std::move(row));
  }
  const nlohmann::json j = {
      {"bench", "optimizer"}, {"threads", torch::get_num_threads()}, {"rows", table}};
  fmt::print("\n{}\n", j.dump());
  return 0;
}
