// The largest model that trains under a fixed memory cap: tiny_lm's decoder (L layers of
// width D, heads of 32 dimensions, a byte vocabulary), D in steps of 32, two training steps
// on one batch, for a plain LibTorch loop (AdamW, float32) and for frugal's combinations. Each
// trial runs in a fresh process (this program, called with --trial), so that no trial inherits
// another's allocations or caches.
//
//   bench_capacity --cap-mib 512 --layers 8 --batch 4 --seq 128 --threads 2
//   bench_capacity --trial plain --dim 512     (one trial: exit 0 trained, 3 out of memory)
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "device.h"
#include "tiny_lm/model.h"

namespace {

struct Args {
  std::int64_t cap_mib = 512;
  std::int64_t layers = 8;
  std::int64_t batch = 4;
  std::int64_t seq = 128;
  std::int64_t max_dim = 8192;
  int threads = 2;
  std::string device = "cpu";
  std::string only;
  std::string trial;  // a configuration's name: run one trial
  std::int64_t dim = 0;
};

constexpr std::int64_t kStep = 32;  // the width's step, and a head's dimensions

tiny_lm::ModelOptions decoder(const Args& a, std::int64_t dim) {
  return tiny_lm::ModelOptions{256, a.seq, dim, dim / kStep, a.layers, 0.0};
}

// One way to train, from the plain loop up; each frugal row adds to the one before (the last
// replaces the one before it).
struct Config {
  const char* name;
  const char* what;
  bool frugal;  // frugal's Trainer: checkpointed blocks, AdamW8bit stepped in backward
  bool autocast;
  bool bf16_weights;
  bool factored;
  double beta1;
  int bits;  // the quantized states' codes
};

const std::vector<Config>& configs() {
  static const std::vector<Config> all{
      {"plain", "LibTorch loop: AdamW, float32", false, false, false, false, 0.9, 8},
      {"8bit", "frugal: checkpointed blocks, bf16 autocast, AdamW8bit stepped in backward", true,
       true, false, false, 0.9, 8},
      {"bf16", "+ bf16 weights and gradients (stochastic rounding), no autocast", true, false, true,
       false, 0.9, 8},
      {"factored", "+ factored second moment (QuantizedStateOptions::factored)", true, false, true,
       true, 0.9, 8},
      {"factored-b0", "+ no first moment (beta1 0)", true, false, true, true, 0.0, 8},
      {"factored-4bit", "(instead of the row before) a 4-bit first moment (AdamW4bit's states)",
       true, false, true, true, 0.9, 4},
  };
  return all;
}

const Config& config_named(const std::string& name) {
  for (const auto& c : configs()) {
    if (name == c.name) {
      return c;
    }
  }
  throw std::invalid_argument("bench_capacity: no configuration '" + name + "'");
}

std::int64_t count_params(torch::nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters()) {
    n += p.numel();
  }
  return n;
}

torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.flatten(0, 1).to(torch::kFloat),
                                              targets.flatten());
}

// Two steps of `config` on a decoder of width a.dim under the cap: 0 when they ran, 3 when
// memory ran out (the model itself included).
int trial(const Args& a) {
  const auto& config = config_named(a.trial);
  torch::set_num_threads(a.threads);
  frugal::CountingAllocator::install();
  const auto device = examples::pick_device(a.device);
  torch::manual_seed(0);
  const auto tokens = torch::randint(0, 256, {a.batch, a.seq}).to(device);
  const auto targets = torch::randint(0, 256, {a.batch, a.seq}).to(device);
  const auto padding = torch::zeros({a.batch, a.seq}, torch::kBool).to(device);
  try {
    // The cap counts the model: built first (and cast, as one loaded in bf16 would be),
    // it must fit with everything else.
    tiny_lm::TinyLM model(decoder(a, a.dim));
    model->to(device, config.bf16_weights ? torch::kBFloat16 : torch::kFloat32);
    frugal::ScopedMemoryCap cap(device, frugal::MiB(a.cap_mib));
    float loss = 0;
    if (!config.frugal) {
      torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-4));
      for (int step = 0; step < 2; ++step) {
        adamw.zero_grad();
        auto l = next_token_loss(model->forward(tokens, padding), targets);
        l.backward();
        adamw.step();
        loss = l.item<float>();
      }
    } else {
      frugal::optim::AdamW8bit adamw(model->parameters(),
                                     torch::optim::AdamWOptions(1e-4).betas({config.beta1, 0.999}),
                                     (config.bits == 4 ? frugal::optim::four_bit_states()
                                                       : frugal::optim::QuantizedStateOptions())
                                         .factored(config.factored));
      frugal::Trainer trainer(
          model.ptr(), adamw,
          [&](const frugal::Batch& b) { return model->forward(b.inputs, b.get("padding")); },
          [](const torch::Tensor& logits, const frugal::Batch& b) {
            return next_token_loss(logits, b.targets);
          },
          frugal::TrainerOptions().device(device));
      trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
          frugal::CheckpointSelect().types({"tiny_lm::Block"})));
      if (config.autocast) {
        frugal::use_mixed_precision(trainer, torch::kBFloat16);
      }
      trainer.add_policy(std::make_shared<frugal::StepInBackward>());
      frugal::Batch batch(tokens, targets);
      batch.set("padding", padding);
      for (int step = 0; step < 2; ++step) {
        loss = static_cast<float>(trainer.step(batch).loss);
      }
    }
    fmt::print("{} dim {}: {} parameters, trained (loss {:.3f})\n", config.name, a.dim,
               count_params(*model), loss);
    return 0;
  } catch (const c10::OutOfMemoryError&) {
  } catch (const frugal::PartialStepError& e) {  // out of memory once the step in backward began
    if (std::string(e.what()).find("out of memory") == std::string::npos) {
      throw;
    }
  }
  fmt::print("{} dim {}: out of memory\n", config.name, a.dim);
  return 3;
}

// Whether `config` trains at width `dim`, in a fresh process.
bool fits(const Args& a, const std::string& self, const Config& config, std::int64_t dim) {
  const auto command = fmt::format(
      "'{}' --trial {} --dim {} --cap-mib {} --layers {} --batch {} --seq {} --threads {} "
      "--device {}",
      self, config.name, dim, a.cap_mib, a.layers, a.batch, a.seq, a.threads, a.device);
  const int status = std::system(command.c_str());
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code != 0 && code != 3) {
    throw std::runtime_error(
        fmt::format("bench_capacity: '{}' ended with status {}", command, status));
  }
  return code == 0;
}

// The widest width (a multiple of kStep) that fits, and the narrowest that did not (past
// --max-dim if none failed): up by half again from `start` while widths fit, then halving
// the gap.
std::pair<std::int64_t, std::int64_t> widest(const Args& a, const std::string& self,
                                             const Config& config, std::int64_t start) {
  std::int64_t lo = 0, hi = a.max_dim + kStep;  // lo fits (0: none known), hi does not
  std::int64_t dim = std::max(kStep, start / kStep * kStep);
  while (dim < hi && fits(a, self, config, dim)) {
    lo = dim;
    dim = std::min(hi, (dim * 3 / 2 + kStep - 1) / kStep * kStep);
  }
  hi = std::min(hi, dim);
  while (hi - lo > kStep) {
    const auto mid = std::max(lo + kStep, (lo + hi) / 2 / kStep * kStep);
    (fits(a, self, config, mid) ? lo : hi) = mid;
  }
  return {lo, hi};
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"The largest decoder that trains under a memory cap: LibTorch's loop and frugal's"};
  app.add_option("--cap-mib", a.cap_mib, "The cap on tensor bytes, in MiB")
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", a.layers, "Decoder blocks")->check(CLI::PositiveNumber);
  app.add_option("--batch", a.batch, "Sequences per step")->check(CLI::PositiveNumber);
  app.add_option("--seq", a.seq, "Tokens per sequence")->check(CLI::Range(8, 4096));
  app.add_option("--max-dim", a.max_dim, "Widest width tried")
      ->check(CLI::Range(kStep, std::int64_t{65536}));
  app.add_option("--threads", a.threads, "Intra-op threads")->check(CLI::Range(1, 256));
  app.add_option("--device", a.device, "cpu, cuda or cuda:N");
  app.add_option("--only", a.only, "One configuration (and the plain loop)");
  app.add_option("--trial", a.trial, "Run one trial of this configuration (internal)");
  app.add_option("--dim", a.dim, "The trial's width (a multiple of 32)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    if (!a.trial.empty()) {
      if (a.dim % kStep != 0) {
        throw std::invalid_argument(fmt::format("--dim {}: not a multiple of {}", a.dim, kStep));
      }
      return trial(a);
    }
    const std::string self = "/proc/self/exe";
    char path[4096];
    const auto length = readlink(self.c_str(), path, sizeof path - 1);
    const std::string exe =
        length > 0 ? std::string(path, static_cast<std::size_t>(length)) : argv[0];
    torch::set_num_threads(a.threads);
    struct Found {
      const Config* config;
      std::int64_t dim, fails;
    };
    std::vector<Found> found;
    std::int64_t start = 256;
    for (const auto& c : configs()) {
      if (!a.only.empty() && a.only != c.name && std::string(c.name) != "plain") {
        continue;
      }
      const auto [dim, fails] = widest(a, exe, c, start);
      found.push_back({&c, dim, fails});
      start = std::max(start, dim);
    }
    const auto params = [&](std::int64_t dim) {
      tiny_lm::TinyLM m(decoder(a, dim));
      return static_cast<double>(count_params(*m));
    };
    const double plain = found.front().dim > 0 ? params(found.front().dim) : 0;
    const double cap = static_cast<double>(frugal::MiB(a.cap_mib));
    fmt::print(
        "\nbench_capacity: tiny_lm decoder, {} layers, width in steps of {} (heads of {}), "
        "{} x {} tokens, two steps under a {} MiB cap on {}; {}\n\n",
        a.layers, kStep, kStep, a.batch, a.seq, a.cap_mib, a.device, bench::machine_line());
    fmt::print(
        "| configuration | widest (next fails) | parameters | cap bytes / parameter | "
        "x plain |\n|---|---|---|---|---|\n");
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& f : found) {
      const double n = f.dim > 0 ? params(f.dim) : 0;
      fmt::print("| {} | {} ({}) | {:.1f} M | {:.2f} | {:.2f} |\n", f.config->what, f.dim, f.fails,
                 n / 1e6, n > 0 ? cap / n : 0.0, plain > 0 ? n / plain : 0.0);
      rows.push_back(
          {{"config", f.config->name}, {"dim", f.dim}, {"fails", f.fails}, {"params", n}});
    }
    const nlohmann::json j = {{"bench", "capacity"}, {"cap_mib", a.cap_mib}, {"layers", a.layers},
                              {"batch", a.batch},    {"seq", a.seq},         {"rows", rows}};
    fmt::print("\n{}\n", j.dump());
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
  return 0;
}
