// What a Lora keeps: its adapted layers and its units, shared with its unit hooks.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <vector>

namespace frugal::nn::detail {

struct LoraLayer {
  std::string name;  // qualified, in the model
  torch::nn::LinearImpl* linear = nullptr;
  torch::nn::Linear a{nullptr}, b{nullptr};  // its children lora_A and lora_B
  torch::Tensor base;                        // the registered parameter `weight`
  torch::Tensor unmerged;                    // the base's bytes while merged
};

struct LoraUnit {
  const torch::nn::Module* module = nullptr;
  std::vector<LoraLayer*> layers;
  bool in_call = false;  // between before_forward and after_forward (not a recompute)
  std::vector<std::pair<LoraLayer*, torch::Tensor>> folded;  // the call's folded weights
};

struct LoraState {
  double scaling = 1;
  bool merged = false;
  std::vector<std::unique_ptr<LoraLayer>> layers;
  std::vector<std::unique_ptr<LoraUnit>> units;
  std::vector<std::pair<torch::Tensor, bool>> trainable;  // each parameter's requires_grad before
};

}  // namespace frugal::nn::detail
