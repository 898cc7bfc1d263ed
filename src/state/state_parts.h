// The pieces of a saved training state that every saved loop has: a model with its
// optimizer, the random number generators, the user's state.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <string>
#include <vector>

#include "frugal/state/training_state.h"

namespace frugal::detail {

/// The archive's keys and their meaning, within the file's format version.
constexpr std::int64_t kStateLayout = 1;

std::string join_lines(const std::vector<std::string>& items, const char* separator = "\n");
std::vector<std::string> split_lines(const std::string& text);

/// "frugal: 'PATH' does not fit WHOSE: WHAT is FILE in the file, HERE here".
std::string state_mismatch(const std::string& path, const std::string& whose,
                           const std::string& what, const std::string& file,
                           const std::string& here);

/// The optimizer's class, as saved files name it (e.g. "torch::optim::Adam").
std::string optimizer_type(const torch::optim::Optimizer& optimizer);

/// A model's parameters and buffers by name, its optimizer's type, param groups (by
/// parameter name) and state, under `prefix` ("" for a Trainer's file).
void write_model(torch::serialize::OutputArchive& archive, const std::string& prefix,
                 torch::nn::Module& module, torch::optim::Optimizer& optimizer);

/// What write_model wrote, checked against `module` and `optimizer` (names, shapes, dtypes,
/// optimizer type and groups) before anything changes; errors name `path` and `whose`.
struct SavedModel {
  std::vector<torch::Tensor> parameters, buffers;
  torch::serialize::InputArchive optimizer;
};
SavedModel read_model(torch::serialize::InputArchive& archive, const std::string& prefix,
                      torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                      const std::string& path, const std::string& whose);
/// Copies the saved parameters and buffers into the module.
void put_back_tensors(torch::nn::Module& module, const SavedModel& saved);

/// The optimizer's state as bytes, and loading it from an archive (state cleared first;
/// each parameter's state then on the parameter's device).
std::string optimizer_bytes(torch::optim::Optimizer& optimizer);
void load_optimizer(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive);
void load_optimizer_bytes(torch::optim::Optimizer& optimizer, const std::string& bytes);
/// Moves each parameter's state to the device of its parameter: a loaded state lies where it
/// was saved (a state saved on the CPU, loaded into a model on CUDA, stays on the CPU).
void place_state_with_parameters(torch::optim::Optimizer& optimizer);

/// The CPU generator's and every CUDA generator's state.
struct SavedRng {
  torch::Tensor cpu;
  std::vector<torch::Tensor> cuda;
};
void write_rng(torch::serialize::OutputArchive& archive);
SavedRng read_rng(torch::serialize::InputArchive& archive, const std::string& path);
void put_back_rng(const SavedRng& rng);

/// The user's values, numbers (bit for bit) and bytes; keys are one non-empty line each.
void check_user_keys(const UserState& user);
void write_user(torch::serialize::OutputArchive& archive, const UserState& user);
UserState read_user(torch::serialize::InputArchive& archive);

/// A state's archive with its layout written; finishing it writes the generators and the
/// user's state and then the file (write_state_file: atomic, checked).
torch::serialize::OutputArchive new_state_archive();
void finish_state(torch::serialize::OutputArchive& archive, const std::string& path,
                  const UserState& user);
/// The archive of a state file, its header and layout checked.
torch::serialize::InputArchive open_state(const std::string& path);

/// Throws `error` again, or, where its message does not name `path` (LibTorch's own words
/// about an archive it cannot read or a key it lacks), an error that does.
[[noreturn]] void rethrow_naming(const std::string& path, const std::exception& error);
/// What `read` returns (the reading and checking of a state file, before anything changes);
/// its errors name `path`.
template <typename Read>
auto read_naming(const std::string& path, Read read) -> decltype(read()) {
  try {
    return read();
  } catch (const std::exception& error) {
    rethrow_naming(path, error);
  }
}

}  // namespace frugal::detail
