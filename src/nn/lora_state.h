// What a Lora keeps: its adapted layers and its units, shared with its unit hooks.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <vector>

#include "nn/unit_weights.h"

namespace frugal::nn::detail {

struct LoraLayer {
  std::string name;                          // qualified, in the model
  torch::nn::Linear a{nullptr}, b{nullptr};  // its children lora_A and lora_B
  torch::Tensor unmerged;                    // the base's bytes while merged
  LinearSlot* slot = nullptr;          // in its unit's hook: the layer and its parameter `weight`
  std::shared_ptr<UnitHook> own_hook;  // with dropout: around the layer's own call
};

struct LoraState {
  double scaling = 1;
  double dropout = 0;
  bool merged = false;
  std::vector<std::unique_ptr<LoraLayer>> layers;
  std::vector<WeightsUnit> units;
  std::vector<std::pair<torch::Tensor, bool>> trainable;  // each parameter's requires_grad before
};

}  // namespace frugal::nn::detail
