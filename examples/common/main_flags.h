// What every example's main does with its flags: --threads, --data-dir for Fashion-MNIST,
// and running the program with a failure's message (frugal::error_message) on standard error and
// exit status 1.
#pragma once

#include <fmt/format.h>
#include <frugal/error.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <exception>
#include <string>

namespace examples {

/// Adds --threads: LibTorch's intra-op threads, set as soon as the flags are parsed
/// (0: LibTorch's choice). Returns the option, for more checks.
inline CLI::Option* threads_flag(CLI::App& app, int& threads,
                                 const std::string& what = "LibTorch threads (0: its default)") {
  app.parse_complete_callback([&threads] {
    if (threads > 0) {
      torch::set_num_threads(threads);
    }
  });
  return app.add_option("--threads", threads, what)->check(CLI::Range(0, 256));
}

/// Adds --seed: a whole number >= 0 (a negative one is refused, not wrapped to 2^64 - 1).
inline CLI::Option* seed_flag(CLI::App& app, std::uint64_t& seed, const std::string& what) {
  return app.add_option("--seed", seed, what)
      ->check(CLI::Validator(
          [](std::string& text) {
            return text.find_first_not_of("0123456789") == std::string::npos && !text.empty()
                       ? std::string()
                       : "must be a whole number >= 0, got " + text;
          },
          "UINT", "whole number >= 0"))
      ->capture_default_str();
}

/// Where Debian's dataset-fashion-mnist package puts the gzipped IDX files.
inline const char* const kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// Adds --data-dir: the folder of Fashion-MNIST's gzipped IDX files, which must exist.
inline CLI::Option* fashion_mnist_flag(CLI::App& app, std::string& dir) {
  return app.add_option("--data-dir", dir, "Folder with Fashion-MNIST's gzipped IDX files")
      ->check(CLI::ExistingDirectory)
      ->capture_default_str();
}

/// Parses the flags (CLI11's help and errors as usual) and returns what `run` returns, or 1
/// after printing the message of what it threw.
template <typename Run>
int parse_and_run(CLI::App& app, int argc, char** argv, Run run) {
  CLI11_PARSE(app, argc, argv);
  try {
    return run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", frugal::error_message(e));
    return 1;
  }
}

}  // namespace examples
