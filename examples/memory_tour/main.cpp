// The memory lesson as a runnable tour: a residual MLP trained under each of frugal's
// policies alone and all together, each measured by the probe against a baseline.
//
//   memory_tour --blocks 8 --width 256 --hidden 2048 --batch 1024 --steps 3
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <nlohmann/json.hpp>

#include "memory_timeline_flags.h"
#include "residual_mlp.h"

namespace {

struct Args {
  std::int64_t blocks = 8, width = 256, hidden = 2048, batch = 1024, steps = 3;
  std::string device = "cpu";
  int threads = 0;
  bool json = false;
  examples::TimelineFlags timeline;  // one file a row: the row's name before the extension
};

// One way of training: which policies are on.
struct Setup {
  std::string name;
  std::int64_t micro_batches = 1;
  bool autocast = false;
  bool checkpoint = false;
  bool set_to_none = false;
  bool keep_losses = false;  // the anti-pattern: loss tensors kept "for logging"
  bool in_place = false;     // frugal::optim::SGD rather than LibTorch's
  bool in_backward = false;  // the optimizer step in backward (with frugal's SGD)
  std::string optimizer = "sgd";      // or "adam", "adam8bit": frugal's, in place
  std::string baseline = "baseline";  // the row it is compared with
};

struct Row {
  std::string name;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // after the last step (-1: not a training row)
  std::int64_t growth = 0;     // allocated after the last step minus after the first
  double ms = 0;
  std::string baseline;  // the row it is compared with
};

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.to(torch::kFloat), y);
}

Row train(const Args& a, const Setup& s, const frugal::Batch& data, torch::Device device) {
  torch::manual_seed(0);
  auto net = models::make_residual_mlp(a.blocks, a.width, a.hidden, 10);
  net->to(device);
  const auto sgd_options = torch::optim::SGDOptions(0.01).momentum(0.9);
  std::unique_ptr<torch::optim::Optimizer> sgd;
  if (s.optimizer == "adam") {
    sgd = std::make_unique<frugal::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-3));
  } else if (s.optimizer == "adam8bit") {
    sgd = std::make_unique<frugal::optim::Adam8bit>(net->parameters(),
                                                    torch::optim::AdamOptions(1e-3));
  } else if (s.in_place || s.in_backward) {
    sgd = std::make_unique<frugal::optim::SGD>(net->parameters(), sgd_options);
  } else {
    sgd = std::make_unique<torch::optim::SGD>(net->parameters(), sgd_options);
  }
  auto options = frugal::TrainerOptions().device(device).set_to_none(s.set_to_none);
  if (s.micro_batches > 1) {
    options.micro_batches(s.micro_batches);
  }
  frugal::Trainer trainer(net, *sgd, cross_entropy, options);
  if (s.in_backward) {
    trainer.add_policy(std::make_shared<frugal::StepInBackward>());
  }
  if (s.checkpoint) {
    trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
        frugal::CheckpointSelect().types({"models::ResidualBlock"})));
  }
  if (s.autocast) {
    frugal::use_mixed_precision(trainer, torch::kBFloat16);
  }
  if (!a.timeline.file.empty()) {
    const auto dot = a.timeline.file.rfind('.');
    auto name = s.name;
    for (auto& c : name) {
      c = std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
    }
    trainer.add_policy(std::make_shared<frugal::MemoryTimeline>(
        a.timeline.file.substr(0, dot) + "." + name + a.timeline.file.substr(dot),
        std::min(a.timeline.step, a.steps)));
  }
  std::vector<torch::Tensor> kept;
  if (s.keep_losses) {
    trainer.add_hook(frugal::Phase::BeforeBackward,
                     [&kept](frugal::StepContext& c) { kept.push_back(c.loss); });
  }
  Row row{s.name, 0, 0, 0, 0, s.baseline};
  std::vector<double> times;
  for (std::int64_t i = 0; i < a.steps; ++i) {
    const auto r = trainer.step(data);
    row.peak = std::max(row.peak, r.peak);
    if (i == 0) {
      row.growth = -r.memory.allocated;
    }
    row.allocated = r.memory.allocated;
    if (i > 0 || a.steps == 1) {
      times.push_back(r.time.total_ms);
    }
  }
  std::sort(times.begin(), times.end());
  row.ms = times[times.size() / 2];
  row.growth += row.allocated;
  return row;
}

Row evaluate(const Args& a, bool no_grad, const frugal::Batch& data, torch::Device device) {
  torch::manual_seed(0);
  auto net = models::make_residual_mlp(a.blocks, a.width, a.hidden, 10);
  net->to(device);
  torch::optim::SGD sgd(net->parameters(), 0.01);
  frugal::Trainer trainer(net, sgd, cross_entropy,
                          frugal::TrainerOptions().device(device).eval_batch(a.batch));
  Row row{no_grad ? "evaluation under no_grad" : "evaluation with grad", 0, -1, 0, 0,
          "evaluation with grad"};
  if (no_grad) {
    const auto e = trainer.evaluate(data);
    row.peak = e.peak;
    row.ms = e.time_ms;
    return row;
  }
  // What evaluation costs when the forward records a graph it never uses.
  const auto start = std::chrono::steady_clock::now();
  frugal::ScopedPeak peak(trainer.probe());
  const auto d = data.to(device);
  const double loss = cross_entropy(net->forward(d.inputs), d.targets).item<double>();
  row.peak = peak.end();
  row.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
               .count();
  (void)loss;
  return row;
}

std::string ratio_note(double value, double base, const char* what) {
  if (base <= 0) {
    return "";
  }
  return value < base ? "" : fmt::format("{} not lower", what);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Each memory policy of frugal, measured on a residual MLP"};
  app.add_option("--blocks", a.blocks, "Residual blocks")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--width", a.width, "Block width")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--hidden", a.hidden, "Hidden width in a block")->check(CLI::Range(1, 1 << 18))->capture_default_str();
  app.add_option("--batch", a.batch, "Samples per step")->check(CLI::Range(4, 1 << 20))->capture_default_str();
  app.add_option("--steps", a.steps, "Steps per policy")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--device", a.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--threads", a.threads, "Intra-op threads (0: LibTorch's choice)")->check(CLI::Range(0, 1024));
  examples::memory_timeline_flags(app, a.timeline);
  app.add_flag("--json", a.json, "Print the table as JSON");
  CLI11_PARSE(app, argc, argv);
  try {
    if (a.threads > 0) {
      torch::set_num_threads(a.threads);
    }
    const torch::Device device(a.device);
    if (device.is_cuda() && !torch::cuda::is_available()) {
      throw std::invalid_argument("--device cuda: CUDA is not available on this machine");
    }
    frugal::CountingAllocator::install();
    torch::manual_seed(1);
    const frugal::Batch data{torch::randn({a.batch, a.width}),
                             torch::randint(0, 10, {a.batch}, torch::kLong)};
    const std::vector<Setup> setups = {
        {"baseline (zero-filled grads, loss logged as a number)", 1, false, false, false, false, false, false},
        {"micro-batching (4 parts)", 4, false, false, false, false, false, false},
        {"autocast bf16", 1, true, false, false, false, false, false},
        {"checkpointing every block", 1, false, true, false, false, false, false},
        {"set_to_none", 1, false, false, true, false, false, false},
        {"frugal::optim::SGD (in place)", 1, false, false, false, false, true, false},
        {"optimizer step in backward", 1, false, false, true, false, true, true},
        {"all together", 4, true, true, true, false, false, false},
        {"all together + step in backward", 4, true, true, true, false, true, true},
        {"loss tensors kept (no detach)", 1, false, false, false, true, false, false},
        {"Adam (frugal::optim::Adam)", 1, false, false, true, false, true, false, "adam"},
        {"8-bit Adam states (frugal::optim::Adam8bit)", 1, false, false, true, false, true, false,
         "adam8bit", "Adam (frugal"},
    };
    std::vector<Row> rows;
    for (const auto& s : setups) {
      rows.push_back(train(a, s, data, device));
    }
    rows.push_back(evaluate(a, false, data, device));
    rows.push_back(evaluate(a, true, data, device));

    auto base_of = [&](const Row& r) -> const Row& {
      return *std::find_if(rows.begin(), rows.end(), [&](const Row& b) {
        return b.name.rfind(r.baseline, 0) == 0;
      });
    };
    if (a.json) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& r : rows) {
        const auto& b = base_of(r);
        out.push_back({{"policy", r.name}, {"peak_bytes", r.peak},
                       {"allocated_bytes", r.allocated}, {"allocated_growth_bytes", r.growth},
                       {"step_ms", r.ms},
                       {"peak_ratio", static_cast<double>(r.peak) / b.peak},
                       {"allocated_ratio", r.allocated > 0 ? static_cast<double>(r.allocated) / b.allocated : 0.0},
                       {"time_ratio", r.ms / b.ms}, {"compared_with", b.name}});
      }
      fmt::print("{}\n", out.dump(2));
      return 0;
    }
    fmt::print("memory_tour: residual MLP, {} blocks, width {}, hidden {}, batch {}, SGD with "
               "momentum (unless the row says), {} steps each, {}, {} threads, LibTorch {}.{}.{}\n\n",
               a.blocks, a.width, a.hidden, a.batch, a.steps, device.str(),
               torch::get_num_threads(), TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR,
               TORCH_VERSION_PATCH);
    fmt::print("| policy | peak | x | allocated after step | x | time (ms) | x | note |\n");
    fmt::print("|---|---|---|---|---|---|---|---|\n");
    for (const auto& r : rows) {
      const auto& b = base_of(r);
      std::vector<std::string> notes;
      if (&b != &r) {
        for (auto note : {ratio_note(static_cast<double>(r.peak), static_cast<double>(b.peak), "peak"),
                          r.allocated >= 0 ? ratio_note(static_cast<double>(r.allocated),
                                                        static_cast<double>(b.allocated), "allocated")
                                           : std::string()}) {
          if (!note.empty()) {
            notes.push_back(note);
          }
        }
      }
      if (r.growth > 0) {
        notes.push_back(fmt::format("allocated grew {} over {} steps", frugal::format_bytes(r.growth),
                                    a.steps));
      }
      std::string joined;
      for (const auto& n : notes) {
        joined += (joined.empty() ? "" : "; ") + n;
      }
      fmt::print("| {} | {} | {:.2f} | {} | {} | {:.1f} | {:.2f} | {} |\n", r.name,
                 frugal::format_bytes(r.peak), static_cast<double>(r.peak) / b.peak,
                 r.allocated >= 0 ? frugal::format_bytes(r.allocated) : "-",
                 r.allocated >= 0 ? fmt::format("{:.2f}", static_cast<double>(r.allocated) / b.allocated) : "-",
                 r.ms, r.ms / b.ms, &b == &r ? "reference" : joined);
    }
    return 0;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "memory_tour: {}\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    fmt::print(stderr, "memory_tour: {}\n", e.what());
  }
  return 1;
}
