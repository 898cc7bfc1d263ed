// The registry of the modules a CheckpointPolicy chose, read by frugal::nn::call.
#pragma once

#include <torch/nn/module.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "frugal/checkpoint.h"

namespace frugal::nn::detail {

/// A module a CheckpointPolicy chose, reached through frugal::nn::call.
struct CallChoice {
  CheckpointOptions options;
  std::atomic<bool> enabled{true};
  std::atomic<std::int64_t> calls{0};  // calls while gradients were recorded
};

/// The registry of chosen modules (thread-safe): a policy adds its choices and removes
/// them when it goes.
void add_call_choice(const torch::nn::Module* module, std::shared_ptr<CallChoice> choice);
void remove_call_choice(const torch::nn::Module* module);

}  // namespace frugal::nn::detail
