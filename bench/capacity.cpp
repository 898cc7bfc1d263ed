// The largest model that trains under a fixed memory cap: tiny_lm's decoder (L layers of
// width D, heads of 32 dimensions, a byte vocabulary), D in steps of 32, two training steps
// on one batch, for a plain LibTorch loop (AdamW, float32) and for frugal's combinations. Each
// trial runs in a fresh process (this program, called with --trial), so that no trial inherits
// another's allocations or caches. With --ranks N the decoder is also trained by N processes
// under ZeRO-3 (each block a unit), each under the cap with its own batch: the per-rank cap
// of data parallel training.
//
//   bench_capacity --cap-mib 512 --layers 8 --batch 4 --seq 128 --threads 2
//   bench_capacity --cap-mib 512 --threads 1 --ranks 2 --only zero3
//   bench_capacity --trial plain --dim 512     (one trial: exit 0 trained, 3 out of memory)
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <frugal/distributed.h>
#include <frugal/frugal.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "capacity_configs.h"
#include "device.h"
#include "local_ranks.h"
#include "tiny_lm/model.h"

namespace {

using namespace bench::capacity;

struct Args {
  std::int64_t cap_mib = 512;
  std::int64_t layers = 8;
  std::int64_t batch = 4;
  std::int64_t seq = 128;
  std::int64_t max_dim = 8192;
  int threads = 2;
  int ranks = 0;  // the ZeRO-3 row's processes (0: no such row)
  std::string device = "cpu";
  std::string only;
  std::string trial;  // a configuration's name: run one trial
  std::int64_t dim = 0;
  bool report = false;   // a trial prints its steps' reports (peak, ledger)
  std::string timeline;  // with report: the second step's recording goes here
};

constexpr std::int64_t kStep = 32;  // the width's step, and a head's dimensions

tiny_lm::ModelOptions decoder(const Args& a, std::int64_t dim) {
  return tiny_lm::ModelOptions{256, a.seq, dim, dim / kStep, a.layers, 0.0};
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

// frugal's Trainer of the decoder: checkpointed blocks, and bf16 autocast if asked.
std::unique_ptr<frugal::Trainer> decoder_trainer(tiny_lm::TinyLM& model,
                                                 torch::optim::Optimizer& optimizer,
                                                 torch::Device device, bool autocast) {
  auto trainer = std::make_unique<frugal::Trainer>(
      model.ptr(), optimizer,
      [net = model.ptr()](const frugal::Batch& b) {
        return net->forward(b.inputs, b.get("padding"));
      },
      [](const torch::Tensor& logits, const frugal::Batch& b) {
        return next_token_loss(logits, b.targets);
      },
      frugal::TrainerOptions().device(device));
  trainer->add_policy(std::make_shared<frugal::CheckpointPolicy>(
      frugal::CheckpointSelect().types({"tiny_lm::Block"})));
  if (autocast) {
    frugal::use_mixed_precision(*trainer, torch::kBFloat16);
  }
  return trainer;
}

// The ZeRO-3 row's trial, in one of the ranks: the decoder is built whole (as one loaded
// would be) and sharded, then the cap holds for the training; every rank trains on its own
// batch. The settings that hold least: no prefetch, units gathered in bf16 from the float32
// ranges, 4 MiB buckets, each block's range updated in backward by AdamW8bit. 0 when two
// steps ran, 3 when this rank ran out of memory; a rank whose peer ran out fails in a
// collective (another status).
int sharded_trial(const Args& a, const Config& config, torch::Device device) {
  namespace fd = frugal::distributed;
  const auto group = fd::LaunchEnv::launched()
                         ? fd::Group::join(fd::LaunchEnv::from_environment(),
                                           fd::GroupOptions().timeout(std::chrono::seconds(120)))
                         : fd::Group::single();
  torch::manual_seed(group->rank());
  const auto tokens = torch::randint(0, 256, {a.batch, a.seq}).to(device);
  const auto targets = torch::randint(0, 256, {a.batch, a.seq}).to(device);
  frugal::Batch batch(tokens, targets);
  batch.set("padding", torch::zeros({a.batch, a.seq}, torch::kBool).to(device));
  try {
    torch::manual_seed(0);
    tiny_lm::TinyLM model(decoder(a, a.dim));
    model->to(device);
    const auto params = count_params(*model);
    fd::ZeroOptimizer zero(
        model->parameters(), group,
        [&](std::vector<torch::Tensor> shard) {
          return std::make_unique<frugal::optim::AdamW8bit>(
              std::move(shard), torch::optim::AdamWOptions(1e-4).betas({config.beta1, 0.999}));
        },
        fd::ZeroOptimizerOptions()
            .stage(3)
            .units(model->blocks->children())
            .prefetch(false)
            .step_in_backward(true)
            .param_dtype(torch::kBFloat16));
    frugal::ScopedMemoryCap cap(device, frugal::MiB(a.cap_mib));
    auto trainer = decoder_trainer(model, zero, device, /*autocast=*/true);
    trainer->add_policy(std::make_shared<fd::DataParallel>(
        group, fd::DataParallelOptions().bucket_bytes(frugal::MiB(4))));
    float loss = 0;
    for (int step = 0; step < 2; ++step) {
      loss = static_cast<float>(trainer->step(batch).loss);
    }
    if (group->rank() == 0) {
      fmt::print("{} dim {}: {} parameters over {} ranks, trained (loss {:.3f})\n", config.name,
                 a.dim, params, group->size(), loss);
    }
    return 0;
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("out of memory") == std::string::npos) {
      throw;
    }
  }
  fmt::print("{} dim {}: rank {} out of memory\n", config.name, a.dim, group->rank());
  return 3;
}

// Two steps of `config` on a decoder of width a.dim under the cap: 0 when they ran, 3 when
// memory ran out (the model itself included).
int trial(const Args& a) {
  const auto& config = config_named(a.trial);
  frugal::CountingAllocator::install();
  const auto device = examples::pick_device(a.device);
  if (config.sharded) {
    return sharded_trial(a, config, device);
  }
  torch::manual_seed(0);
  const auto tokens = torch::randint(0, 256, {a.batch, a.seq}).to(device);
  const auto targets = torch::randint(0, 256, {a.batch, a.seq}).to(device);
  const auto padding = torch::zeros({a.batch, a.seq}, torch::kBool).to(device);
  try {
    // With 8-bit weights the cap holds from the model's first tensor on: each block is
    // stored as it is made, the rest (embeddings, norm, head) cast to bfloat16.
    std::unique_ptr<frugal::ScopedMemoryCap> cap;
    std::unique_ptr<frugal::nn::Int8Weights> int8;
    auto options = decoder(a, a.dim);
    if (config.int8) {
      cap = std::make_unique<frugal::ScopedMemoryCap>(device, frugal::MiB(a.cap_mib));
      int8 = std::make_unique<frugal::nn::Int8Weights>(
          frugal::nn::Int8WeightsOptions().dtype(torch::kBFloat16));
      options.int8 = int8.get();
    }
    // Otherwise the cap counts the model: built first (and cast, as one loaded in bf16
    // would be), it must fit with everything else.
    tiny_lm::TinyLM model(options);
    if (config.int8) {
      for (auto* m : std::initializer_list<torch::nn::Module*>{
               model->tokens.get(), model->positions.get(), model->norm.get(), model->head.get()}) {
        m->to(device, torch::kBFloat16);
      }
      model->blocks->to(device);  // codes and statistics (uint8, bfloat16) as they are
    } else {
      model->to(device, config.bf16_weights ? torch::kBFloat16 : torch::kFloat32);
      cap = std::make_unique<frugal::ScopedMemoryCap>(device, frugal::MiB(a.cap_mib));
    }
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
      auto trainer = decoder_trainer(model, adamw, device, config.autocast);
      trainer->add_policy(std::make_shared<frugal::StepInBackward>());
      frugal::Batch batch(tokens, targets);
      batch.set("padding", padding);
      if (a.report) {
        fmt::print("built: {}\n", frugal::MemoryProbe(device).snapshot().summary());
      }
      for (int step = 0; step < 2; ++step) {
        // With --report, the second step is recorded: what is alive at its peak.
        std::optional<frugal::MemoryRecorder> recorder;
        if (a.report && step == 1) {
          recorder.emplace(frugal::MemoryRecorderOptions().device(device));
          recorder->watch(*model, &adamw);
        }
        const auto report = trainer->step(batch);
        loss = static_cast<float>(report.loss);
        if (a.report) {
          fmt::print("{}\n", report.summary());
        }
        if (recorder) {
          recorder->stop();
          fmt::print("{}\n", recorder->peak().summary(24));
          if (!a.timeline.empty()) {
            recorder->write(a.timeline);
          }
        }
      }
    }
    fmt::print("{} dim {}: {} parameters, trained (loss {:.3f})\n", config.name, a.dim,
               count_params(*model) + (int8 != nullptr ? int8->stored_elements() : 0), loss);
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

// The command line of one trial of `config` at width `dim`.
std::vector<std::string> trial_command(const Args& a, const std::string& self, const Config& config,
                                       std::int64_t dim) {
  return {self,
          "--trial",
          config.name,
          "--dim",
          std::to_string(dim),
          "--cap-mib",
          std::to_string(a.cap_mib),
          "--layers",
          std::to_string(a.layers),
          "--batch",
          std::to_string(a.batch),
          "--seq",
          std::to_string(a.seq),
          "--threads",
          std::to_string(a.threads),
          "--device",
          a.device};
}

// The ZeRO-3 trial as --ranks processes, started with the variables torchrun sets: whether
// every rank trained (true), or one ran out of memory (false).
bool sharded_fits(const Args& a, const std::string& self, const Config& config, std::int64_t dim) {
  const auto codes = examples::run_local_ranks(trial_command(a, self, config, dim), a.ranks);
  if (std::all_of(codes.begin(), codes.end(), [](int c) { return c == 0; })) {
    return true;
  }
  if (std::find(codes.begin(), codes.end(), 3) != codes.end()) {
    return false;
  }
  throw std::runtime_error(fmt::format("bench_capacity: {} at width {}: ranks ended with {}",
                                       config.name, dim, fmt::join(codes, ", ")));
}

// Whether `config` trains at width `dim`, in a fresh process (or --ranks of them).
bool fits(const Args& a, const std::string& self, const Config& config, std::int64_t dim) {
  if (config.sharded) {
    return sharded_fits(a, self, config, dim);
  }
  const auto command = fmt::format("'{}'", fmt::join(trial_command(a, self, config, dim), "' '"));
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
  bench::threads_flag(app, a.threads, "Intra-op threads")->check(CLI::Range(1, 256));
  app.add_option("--device", a.device, "cpu, cuda or cuda:N");
  app.add_option("--only", a.only, "One configuration (and the plain loop)");
  app.add_option("--ranks", a.ranks,
                 "Add the ZeRO-3 row: this many processes, each under the cap (1: a group of one)")
      ->check(CLI::Range(1, 64));
  app.add_option("--trial", a.trial, "Run one trial of this configuration (internal)");
  app.add_flag("--report", a.report,
               "A trial prints each step's report, and what is alive at the second step's peak");
  app.add_option("--timeline", a.timeline,
                 "With --report: write the second step's recording here (.html, .json, .pickle)");
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
    struct Found {
      const Config* config;
      std::int64_t dim, fails;
      double params;  // 0 where no width fit
    };
    // Each row's parameters, counted once from a model of its width.
    const auto params = [&](std::int64_t dim) {
      tiny_lm::TinyLM m(decoder(a, dim));
      return static_cast<double>(count_params(*m));
    };
    std::vector<Found> found;
    std::int64_t start = 256;
    for (const auto& c : configs()) {
      if ((!a.only.empty() && a.only != c.name && std::string(c.name) != "plain") ||
          (c.sharded && a.ranks == 0)) {
        continue;
      }
      const auto [dim, fails] = widest(a, exe, c, start);
      found.push_back({&c, dim, fails, dim > 0 ? params(dim) : 0.0});
      start = std::max(start, dim);
    }
    const double plain = found.front().params;
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
      const double n = f.params;
      fmt::print("| {} | {} ({}) | {:.1f} M | {:.2f} | {:.2f} |\n", f.config->what, f.dim, f.fails,
                 n / 1e6, n > 0 ? cap / n : 0.0, plain > 0 ? n / plain : 0.0);
      rows.push_back(
          {{"config", f.config->name}, {"dim", f.dim}, {"fails", f.fails}, {"params", n}});
    }
    const auto row = [&](const char* name) {
      const auto f = std::find_if(found.begin(), found.end(), [&](const Found& x) {
        return std::string(x.config->name) == name;
      });
      return f != found.end() ? f->params : 0.0;
    };
    const double sharded = row("zero3"), one_process = row("8bit");
    if (sharded > 0 && one_process > 0) {
      fmt::print(
          "\nZeRO-3 over {} ranks / one process of frugal (the 8bit row): {:.2f}x the parameters\n",
          a.ranks, sharded / one_process);
    }
    const nlohmann::json j = {{"bench", "capacity"}, {"cap_mib", a.cap_mib}, {"layers", a.layers},
                              {"batch", a.batch},    {"seq", a.seq},         {"ranks", a.ranks},
                              {"rows", rows}};
    fmt::print("\n{}\n", j.dump());
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
  return 0;
}
