// Small trainers under each configuration a saved state must resume bit for bit, built the
// same way in every process.
#pragma once

#include <frugal/frugal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "compat.h"
#include "helpers.h"

namespace frugal::testing {

/// Linear, ReLU and dropout: the block the checkpointed configuration recomputes.
struct ResumeBlockImpl : torch::nn::Module {
  ResumeBlockImpl(std::int64_t in, std::int64_t out)
      : linear(register_module("linear", torch::nn::Linear(in, out))),
        dropout(register_module("dropout", torch::nn::Dropout(0.2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return dropout(torch::relu(linear(x))); }
  torch::nn::Linear linear;
  torch::nn::Dropout dropout;
};
TORCH_MODULE(ResumeBlock);

struct ResumeSetup {
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<Trainer> trainer;
};

/// The configurations: LibTorch's Adam plain; frugal's SGD with micro-batches, an
/// accumulation window and OomRecovery; bf16 autocast; fp16 with a GradScaler where the CPU
/// has fp16 autocast; checkpointed blocks with dropout and a cosine schedule; 8-bit Adam
/// with step decay; the optimizer step in backward; bfloat16 weights with stochastic rounding
/// (the inputs cast to bfloat16 before each forward).
inline std::vector<std::string> resume_configs() {
  std::vector<std::string> out{"plain",    "micro",       "bf16",        "checkpoint",
                               "adam8bit", "in-backward", "bf16-weights"};
  if (compat::autocast_supports(c10::DeviceType::CPU, torch::kHalf)) {
    out.push_back("fp16");
  }
  return out;
}

/// 320 samples of 16 features in 4 classes, from their own generator (the global one untouched).
inline Batch resume_data() {
  auto generator = torch::make_generator<torch::CPUGeneratorImpl>(99);
  auto x = torch::randn({320, 16}, generator);
  auto y =
      (x.narrow(1, 0, 4).argmax(1) + (x.narrow(1, 4, 1).squeeze(1) > 1.0).to(torch::kLong)) % 4;
  return {x, y};
}

inline std::unique_ptr<ResumeSetup> make_resume_setup(const std::string& config,
                                                      std::int64_t hidden = 32,
                                                      torch::Device device = torch::kCPU) {
  namespace nn = torch::nn;
  auto out = std::make_unique<ResumeSetup>();
  torch::manual_seed(11);
  out->model =
      nn::Sequential(ResumeBlock(16, hidden), ResumeBlock(hidden, hidden), nn::Linear(hidden, 4));
  out->model->to(device);
  if (config == "bf16-weights") {
    out->model->to(torch::kBFloat16);
  }
  auto params = out->model->parameters();
  namespace to = torch::optim;
  if (config == "plain") {
    out->optimizer = std::make_unique<to::Adam>(params, to::AdamOptions(1e-2));
  } else if (config == "micro") {
    out->optimizer = std::make_unique<optim::SGD>(params, to::SGDOptions(0.05).momentum(0.9));
  } else if (config == "checkpoint") {
    out->optimizer = std::make_unique<optim::AdamW>(params, to::AdamWOptions(1e-2));
  } else if (config == "bf16-weights") {
    out->optimizer = std::make_unique<optim::AdamW>(params, to::AdamWOptions(1e-2),
                                                    optim::InPlaceOptions().seed(3));
  } else if (config == "adam8bit") {
    out->optimizer = std::make_unique<optim::Adam8bit>(
        params, to::AdamOptions(1e-2), optim::QuantizedStateOptions().min_elements(64));
  } else {
    out->optimizer = std::make_unique<optim::Adam>(params, to::AdamOptions(1e-2));
  }
  auto options = TrainerOptions().device(device);
  if (config == "micro") {
    options.micro_batch(8).accumulate(2);
  }
  out->trainer = std::make_unique<Trainer>(
      out->model, *out->optimizer,
      [](const torch::Tensor& o, const torch::Tensor& y) {
        return torch::nn::functional::cross_entropy(o.to(torch::kFloat32), y);
      },
      options);
  auto& trainer = *out->trainer;
  if (config == "micro") {
    trainer.add_policy(std::make_shared<OomRecovery>());
  } else if (config == "bf16") {
    use_mixed_precision(trainer, torch::kBFloat16);
  } else if (config == "fp16") {
    use_mixed_precision(trainer, torch::kHalf);
  } else if (config == "checkpoint") {
    trainer.add_policy(std::make_shared<CheckpointPolicy>(CheckpointSelect().names({"0", "1"})));
    trainer.add_policy(std::make_shared<LrSchedule>(
        LrScheduleOptions().decay(LrDecay::Cosine).warmup_steps(10).total_steps(100)));
  } else if (config == "adam8bit") {
    trainer.add_policy(std::make_shared<LrSchedule>(
        LrScheduleOptions().decay(LrDecay::Step).step_size(30).gamma(0.5)));
  } else if (config == "in-backward") {
    trainer.add_policy(std::make_shared<StepInBackward>());
  } else if (config == "bf16-weights") {
    trainer.add_hook(Phase::BeforeForward,
                     [](StepContext& c) { c.micro.inputs = c.micro.inputs.to(torch::kBFloat16); });
  }
  return out;
}

/// Trains `steps` batches of 32 of resume_data(), going on from the trainer's batch count.
inline void train(ResumeSetup& s, int steps) {
  const auto data = resume_data();
  for (int i = 0; i < steps; ++i) {
    const auto start = (s.trainer->counters().batches * 32) % 320;
    s.trainer->step(data.slice(start, 32));
  }
}

/// Puts a new optimizer under the setup's model, with a new trainer and no policies.
inline void replace_optimizer(ResumeSetup& s, std::unique_ptr<torch::optim::Optimizer> optimizer) {
  s.trainer.reset();  // it refers to the old optimizer
  s.optimizer = std::move(optimizer);
  s.trainer = std::make_unique<Trainer>(s.model, *s.optimizer,
                                        [](const torch::Tensor& o, const torch::Tensor& y) {
                                          return torch::nn::functional::cross_entropy(o, y);
                                        });
}

/// The parameters and buffers, flattened into one tensor, for bitwise comparison.
inline torch::Tensor flat_state(torch::nn::Module& module) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : module.parameters()) {
    parts.push_back(p.detach().flatten().to(torch::kDouble));
  }
  for (const auto& b : module.buffers()) {
    parts.push_back(b.detach().flatten().to(torch::kDouble));
  }
  return torch::cat(parts);
}

}  // namespace frugal::testing
