// Resident memory of an MNIST-style program (LibTorch's MNIST example's shape: a CNN, Adam,
// a torch::data DataLoader with worker threads, an evaluation pass) with frugal and
// without it, each in a process of its own. Without: FRUGAL_COUNTING_ALLOCATOR=0 and a plain
// loop, so LibTorch's own allocator serves every tensor and no frugal code runs.
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "bench_util.h"
#include "models.h"

namespace {

// Fashion-MNIST as a map-style LibTorch dataset of single examples.
struct Fashion : torch::data::datasets::Dataset<Fashion> {
  explicit Fashion(frugal::Batch all) : all(std::move(all)) {}
  torch::data::Example<> get(std::size_t i) override {
    const auto k = static_cast<std::int64_t>(i);
    return {all.inputs[k], all.targets[k]};
  }
  c10::optional<std::size_t> size() const override {
    return static_cast<std::size_t>(all.inputs.size(0));
  }
  frugal::Batch all;
};

// A field of /proc/self/status in KiB (VmRSS, VmHWM).
std::int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) {
      return std::stoll(line.substr(field.size() + 1));
    }
  }
  return -1;
}

// The first `count` samples of `all` (all of them for 0).
frugal::Batch first(frugal::Batch all, std::int64_t count) {
  if (count > 0 && count < all.inputs.size(0)) {
    all.inputs = all.inputs.narrow(0, 0, count).clone();
    all.targets = all.targets.narrow(0, 0, count).clone();
  }
  return all;
}

nlohmann::json train(const std::string& mode, const std::string& data_dir, int steps,
                     std::int64_t batch, int workers, std::int64_t test_samples) {
  torch::manual_seed(0);
  auto loader = torch::data::make_data_loader(
      Fashion(frugal::data::load_mnist_dir(data_dir, frugal::data::Split::Train))
          .map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions()
          .batch_size(static_cast<std::size_t>(batch))
          .workers(static_cast<std::size_t>(workers)));
  auto test = torch::data::make_data_loader(
      Fashion(
          first(frugal::data::load_mnist_dir(data_dir, frugal::data::Split::Test), test_samples))
          .map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(1000).workers(static_cast<std::size_t>(workers)));
  auto model = fashion::make_cnn(0.0);
  torch::optim::Adam adam(model->parameters(), 1e-3);
  auto loss_fn = [](const torch::Tensor& o, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(o, t);
  };
  std::unique_ptr<frugal::Trainer> trainer;
  if (mode == "frugal") {
    trainer = std::make_unique<frugal::Trainer>(model, adam, loss_fn);
  }
  int done = 0;
  double loss = 0;
  while (done < steps) {
    for (auto& b : *loader) {
      if (trainer) {
        loss = trainer->step({b.data, b.target}).loss;
      } else {
        adam.zero_grad();
        auto l = loss_fn(model->forward(b.data), b.target);
        l.backward();
        adam.step();
        loss = l.item<double>();
      }
      if (++done == steps) {
        break;
      }
    }
  }
  double test_loss = 0;
  if (trainer) {
    test_loss = trainer->evaluate(*test).loss;
  } else {
    torch::NoGradGuard no_grad;
    model->eval();
    double sum = 0;
    std::int64_t n = 0;
    for (auto& b : *test) {
      sum += loss_fn(model->forward(b.data), b.target).item<double>() * b.data.size(0);
      n += b.data.size(0);
    }
    test_loss = sum / static_cast<double>(n);
  }
  nlohmann::json j = {{"mode", mode},
                      {"steps", done},
                      {"loss", loss},
                      {"test_loss", test_loss},
                      {"peak_rss_kib", status_kib("VmHWM")},
                      {"rss_kib", status_kib("VmRSS")}};
  if (frugal::CountingAllocator::installed()) {
    const auto s = frugal::CountingAllocator::stats();
    j["allocated_bytes"] = s.allocated;
    j["peak_reserved_bytes"] = s.peak_reserved;
    j["cached_bytes"] = s.cached;
    j["rounding_bytes"] = s.rounding;
  }
  return j;
}

// Runs this program again in `mode` (a process of its own) and returns its JSON line.
nlohmann::json run_child(const std::string& self, const std::string& mode,
                         const std::string& args) {
  const auto env = mode == "plain" ? "FRUGAL_COUNTING_ALLOCATOR=0 " : "";
  const auto cmd = fmt::format("{}{} --mode {} {}", env, self, mode, args);
  FILE* pipe = popen(cmd.c_str(), "r");
  FRUGAL_CHECK(pipe != nullptr, "bench_rss: cannot run ", cmd);
  std::string out;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) {
    out += buffer;
  }
  FRUGAL_CHECK(pclose(pipe) == 0, "bench_rss: ", cmd, " failed:\n", out);
  return nlohmann::json::parse(out.substr(out.rfind('{')));
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "both", data_dir = "/usr/share/datasets/fashion-mnist";
  int steps = 300, workers = 2, rounds = 1, threads = 0;
  std::int64_t batch = 64, cache_limit = 0, test_samples = 0;
  CLI::App app{"Resident memory of an MNIST-style program with frugal and without"};
  app.add_option("--mode", mode, "both (each in a process of its own), plain or frugal")
      ->check(CLI::IsMember({"both", "plain", "frugal"}));
  app.add_option("--data-dir", data_dir)->capture_default_str();
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--batch", batch)->capture_default_str();
  app.add_option("--workers", workers, "DataLoader worker threads")->capture_default_str();
  app.add_option("--rounds", rounds, "pairs of processes, alternating")->capture_default_str();
  bench::threads_flag(app, threads, "Intra-op threads (0: LibTorch's choice)");
  app.add_option("--test-samples", test_samples,
                 "Evaluate on the first this many test samples (0: all 10000)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--cache-limit", cache_limit,
                 "frugal's CPU cache limit in bytes (0: its default rule)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  frugal::CountingAllocator::set_cache_limit(cache_limit);
  if (mode != "both") {
    fmt::print("{}\n", train(mode, data_dir, steps, batch, workers, test_samples).dump());
    return 0;
  }
  const auto args = fmt::format(
      "--data-dir {} --steps {} --batch {} --workers {} --threads {} --cache-limit {} "
      "--test-samples {}",
      data_dir, steps, batch, workers, threads, cache_limit, test_samples);
  std::vector<double> plain, ours;
  nlohmann::json last_plain, last_ours;
  for (int r = 0; r < rounds; ++r) {
    last_plain = run_child(argv[0], "plain", args);
    last_ours = run_child(argv[0], "frugal", args);
    plain.push_back(last_plain["peak_rss_kib"].get<double>());
    ours.push_back(last_ours["peak_rss_kib"].get<double>());
  }
  const double p = bench::median(plain), f = bench::median(ours);
  fmt::print(
      "Peak resident memory (VmHWM) of an MNIST-style program: CNN, Adam, DataLoader with "
      "{} workers, batch {}, {} steps and an evaluation on {} test samples, {} round(s); {}\n\n",
      workers, batch, steps, test_samples > 0 ? fmt::to_string(test_samples) : "all 10000", rounds,
      bench::machine_line());
  fmt::print("| program | peak RSS (MiB) | ratio |\n|---|---|---|\n");
  fmt::print("| LibTorch alone | {:.1f} | 1.000 |\n", p / 1024);
  fmt::print("| with frugal (Trainer, probe, ledger) | {:.1f} | {:.3f} |\n\n", f / 1024, f / p);
  nlohmann::json j = {{"bench", "rss"}, {"plain_kib", p},      {"frugal_kib", f},
                      {"ratio", f / p}, {"plain", last_plain}, {"frugal", last_ours}};
  fmt::print("{}\n", j.dump());
  return 0;
}
