// Saving and loading the whole training state of the Fashion-MNIST CNN, against writing its
// raw bytes (weights and optimizer state) to a file with the same durability (write, fsync,
// rename, fsync of the folder), side by side.
//
//   bench_save_state --rounds 9 --dir /tmp --optimizer adam
#include <fcntl.h>
#include <fmt/format.h>
#include <frugal/frugal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench_util.h"
#include "models.h"

namespace {

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// The baseline: `bytes` written from memory as durably as a save is.
double write_raw(const std::string& path, const std::vector<char>& bytes) {
  const auto start = std::chrono::steady_clock::now();
  const auto tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::size_t done = 0;
  while (fd >= 0 && done < bytes.size()) {
    const auto n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (fd < 0 || done != bytes.size() || ::fsync(fd) != 0 || ::close(fd) != 0 ||
      std::rename(tmp.c_str(), path.c_str()) != 0) {
    throw std::runtime_error("cannot write " + path);
  }
  const auto dir = std::filesystem::path(path).parent_path().string();
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  ::fsync(dir_fd);
  ::close(dir_fd);
  return ms_since(start);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 9, threads = 2;
  std::string dir = "/tmp", optimizer_name = "adam";
  CLI::App app{"Saving and loading the CNN's training state against writing its raw bytes"};
  app.add_option("--rounds", rounds, "Interleaved rounds")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "Intra-op threads")->check(CLI::PositiveNumber);
  app.add_option("--dir", dir, "Folder to write in")->check(CLI::ExistingDirectory);
  app.add_option("--optimizer", optimizer_name, "adam or adam8bit")
      ->check(CLI::IsMember({"adam", "adam8bit"}));
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(threads);
  frugal::CountingAllocator::install();

  torch::manual_seed(0);
  auto model = fashion::make_cnn(0.4);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (optimizer_name == "adam8bit") {
    optimizer = std::make_unique<frugal::optim::Adam8bit>(model->parameters(),
                                                          torch::optim::AdamOptions(1e-3));
  } else {
    optimizer =
        std::make_unique<frugal::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  }
  frugal::Trainer trainer(model, *optimizer, [](const torch::Tensor& o, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(o, y);
  });
  trainer.step({torch::rand({64, 1, 28, 28}), torch::randint(10, {64})});  // the state exists

  const auto ledger = frugal::measure_ledger(trainer.probe(), *model, optimizer.get());
  const std::vector<char> raw(static_cast<std::size_t>(ledger.weights + ledger.optimizer), 1);
  const auto state_path = dir + "/bench_state.frugal";
  const auto raw_path = dir + "/bench_raw.bin";
  const auto times = bench::interleave({{"raw", [&] { return write_raw(raw_path, raw); }},
                                        {"save",
                                         [&] {
                                           const auto start = std::chrono::steady_clock::now();
                                           frugal::save_training_state(trainer, state_path);
                                           return ms_since(start);
                                         }},
                                        {"load",
                                         [&] {
                                           const auto start = std::chrono::steady_clock::now();
                                           frugal::load_training_state(trainer, state_path);
                                           return ms_since(start);
                                         }}},
                                       rounds);
  const auto file_bytes = static_cast<std::int64_t>(std::filesystem::file_size(state_path));
  const double raw_ms = bench::median(times.at("raw"));
  const double save_ms = bench::median(times.at("save"));
  const double load_ms = bench::median(times.at("load"));
  fmt::print("CNN with frugal's {}: {} of weights + optimizer state; file {} ({:.4f}x); {}\n",
             optimizer_name, frugal::format_bytes(static_cast<std::int64_t>(raw.size())),
             frugal::format_bytes(file_bytes),
             static_cast<double>(file_bytes) / static_cast<double>(raw.size()),
             bench::machine_line());
  fmt::print("| what | median ms | vs raw write |\n|---|---:|---:|\n");
  fmt::print("| raw bytes: write, fsync, rename | {:.1f} | 1.00x |\n", raw_ms);
  fmt::print("| save_training_state | {:.1f} | {:.2f}x |\n", save_ms, save_ms / raw_ms);
  fmt::print("| load_training_state | {:.1f} | {:.2f}x |\n", load_ms, load_ms / raw_ms);
  fmt::print("{} rounds interleaved, {}\n", rounds, bench::machine_line());
  const nlohmann::json j = {{"bench", "save_state"},    {"optimizer", optimizer_name},
                            {"raw_ms", raw_ms},         {"save_ms", save_ms},
                            {"load_ms", load_ms},       {"file_bytes", file_bytes},
                            {"state_bytes", raw.size()}};
  fmt::print("{}\n", j.dump());
  std::filesystem::remove(state_path);
  std::filesystem::remove(raw_path);
  return 0;
}
