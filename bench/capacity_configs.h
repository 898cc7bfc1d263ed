// The ways to train that bench_capacity compares under one memory cap, from LibTorch's plain
// loop up through frugal's combinations.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace bench::capacity {

// One way to train, from the plain loop up; each frugal row adds to the one before (the last
// replaces the one before it).
struct Config {
  const char* name;
  const char* what;
  bool frugal;  // frugal's Trainer: checkpointed blocks, AdamW8bit stepped in backward
  bool autocast;
  bool bf16_weights;
  bool factored;
  double beta1;
  int bits;              // the quantized states' codes
  bool sharded = false;  // ZeRO-3 over --ranks processes, each block a unit
  bool int8 = false;     // the blocks' weights in 8 bits (Int8Weights), built under the cap
};

inline const std::vector<Config>& configs() {
  static const std::vector<Config> all{
      {"plain", "LibTorch loop: AdamW, float32", false, false, false, false, 0.9, 8},
      {"8bit", "frugal: checkpointed blocks, bf16 autocast, AdamW8bit stepped in backward", true,
       true, false, false, 0.9, 8},
      {"bf16", "+ bf16 weights and gradients (stochastic rounding), no autocast", true, false, true,
       false, 0.9, 8},
      {"factored", "+ factored second moment (QuantizedStateOptions::factored)", true, false, true,
       true, 0.9, 8},
      {"factored-b0", "+ no first moment (beta1 0)", true, false, true, true, 0.0, 8},
      {"factored-4bit", "(instead of the row before) a 4-bit first moment (AdamW4bit's states)",
       true, false, true, true, 0.9, 4},
      {"int8",
       "+ 8-bit weights (frugal::nn::Int8Weights, stochastic rounding), the model built into "
       "them under the cap",
       true, false, true, true, 0.9, 4, false, true},
      {"int8-b0", "+ no first moment (beta1 0)", true, false, true, true, 0.0, 4, false, true},
      {"zero3",
       "frugal over --ranks processes, per rank: ZeRO-3 with each block a unit gathered in "
       "bf16 (no prefetch), checkpointed blocks, bf16 autocast, AdamW8bit",
       true, true, false, false, 0.9, 8, true},
  };
  return all;
}

inline const Config& config_named(const std::string& name) {
  for (const auto& c : configs()) {
    if (name == c.name) {
      return c;
    }
  }
  throw std::invalid_argument("bench_capacity: no configuration '" + name + "'");
}

}  // namespace bench::capacity
