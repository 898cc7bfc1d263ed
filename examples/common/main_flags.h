// What every example's main does with its flags: --threads, and running the program with
// a failure's message (frugal::error_message) on standard error and exit status 1.
#pragma once

#include <fmt/format.h>
#include <frugal/error.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
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
  return app.add_option("--threads", threads, what)->check(CLI::NonNegativeNumber);
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
