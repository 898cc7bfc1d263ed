// The harness of the ZeRO-3 unit tests: a residual model of blocks (each a unit), and one
// training run of it under a mode and a ZeRO stage, with what the probe saw.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "children.h"
#include "dist_launch.h"
#include "frugal/compose/mixed_precision.h"
#include "frugal/distributed/data_parallel.h"
#include "frugal/distributed/shard.h"
#include "frugal/distributed/zero.h"
#include "frugal/error.h"
#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/optim/adam.h"
#include "frugal/optim/sgd.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/policy/leak_guard.h"
#include "frugal/train/trainer.h"

namespace frugal::testing::zero_units {

using frugal::distributed::Group;
using frugal::distributed::ZeroOptimizer;
using frugal::distributed::ZeroOptimizerOptions;

constexpr std::int64_t kWidth = 64;
constexpr std::int64_t kBlocks = 8;
constexpr std::int64_t kSteps = 20;
constexpr std::int64_t kGlobal = 32;

// Called at the start of every block's forward and when a block's input gradient is in.
inline std::function<void(bool backward)> g_block_seen;

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(kWidth, kWidth))) {}
  torch::Tensor forward(torch::Tensor x) {
    if (g_block_seen) {
      g_block_seen(false);
      if (x.requires_grad()) {
        x.register_hook([](const torch::Tensor&) {
          if (g_block_seen) {
            g_block_seen(true);
          }
        });
      }
    }
    return x + torch::tanh(fc(x));
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

struct UnitNetImpl : torch::nn::Module {
  UnitNetImpl()
      : embed(register_module("embed", torch::nn::Linear(8, kWidth))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(kWidth, 4))) {
    for (std::int64_t b = 0; b < kBlocks; ++b) {
      blocks->push_back(Block());
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    x = embed(x);
    for (std::size_t b = 0; b < blocks->size(); ++b) {
      x = frugal::nn::call(blocks->ptr<BlockImpl>(b), x);
    }
    return head(x);
  }
  std::int64_t whole_blocks() const {
    std::int64_t n = 0;
    for (std::size_t b = 0; b < blocks->size(); ++b) {
      n += blocks->ptr<BlockImpl>(b)->fc->weight.numel() > 0 ? 1 : 0;
    }
    return n;
  }
  torch::nn::Linear embed;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(UnitNet);

inline torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

// frugal's optimizers (`in_place`, which ZeRO's step in backward needs) or LibTorch's.
inline std::unique_ptr<torch::optim::Optimizer> make_inner(const std::string& mode,
                                                           std::vector<torch::Tensor> params,
                                                           bool in_place = false) {
  if (mode == "sgd" || mode == "bf16" || mode == "bf16w") {  // Adam: bf16's last bits on
    const auto options = torch::optim::SGDOptions(0.05).momentum(0.9);
    if (in_place) {
      return std::make_unique<frugal::optim::SGD>(params, options);
    }
    return std::make_unique<torch::optim::SGD>(params, options);
  }
  if (in_place) {
    return std::make_unique<frugal::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
  }
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-3));
}

// A model's parameters in a low-precision dtype trained through float32 copies: the
// inner optimizer updates the copies with the parameters' gradients, and each step rounds
// them into the parameters (what ZeRO's param_dtype does, without the shards).
class MasterCopy : public torch::optim::Optimizer {
 public:
  using Make = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  MasterCopy(std::vector<torch::Tensor> params, torch::Dtype dtype, const Make& make)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(params)},
                                std::make_unique<torch::optim::SGDOptions>(0)),
        params_(std::move(params)) {
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      masters_.push_back(p.detach().to(torch::kFloat).clone().requires_grad_(true));
      p.set_data(p.detach().to(dtype));
    }
    inner_ = make(masters_);
  }
  torch::Tensor step(LossClosure closure = nullptr) override {
    (void)closure;
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& grad = params_[i].grad();
      masters_[i].mutable_grad() = grad.defined() ? grad.to(torch::kFloat) : torch::Tensor();
    }
    inner_->step();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      params_[i].detach().copy_(masters_[i]);
    }
    return {};
  }

 private:
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> masters_;
  std::unique_ptr<torch::optim::Optimizer> inner_;
};

// How a run went: the weights (whole), the losses, and what the probe saw.
struct Run {
  std::vector<torch::Tensor> weights;
  std::vector<double> losses;
  std::int64_t weights_after_forward = 0;  // ledger, after the last forward of the last step
  std::int64_t weights_at_step = 0;        // ledger, at the last optimizer step
  std::int64_t weights_between = 0;        // ledger, after the last step
  std::int64_t peak = 0;                   // the highest step peak, above the run's start
  std::int64_t whole_in_forward = 0;       // the most blocks whole inside a block's forward
  std::int64_t whole_in_backward = 0;      // ... when a block's input gradient was in
  std::int64_t weights_in_forward = 0;     // ledger, the most inside a block's forward
  std::int64_t rest_after_forward = 0;     // ledger's other, above the run's start
  std::int64_t setup_peak = 0;             // the peak while DataParallel was added
  std::int64_t gradients_at_step = 0;      // ledger, the most at an optimizer step
  std::int64_t gradients_in_backward = 0;  // ledger, the most when a block's gradient was in
  double eval_loss = 0;
};

// mode: adam, sgd, micro (micro-batches, an accumulation window, checkpointed blocks, leak
// guard), bf16 (autocast) or bf16w (autocast, the weights gathered in bf16: ZeRO's
// param_dtype; without ZeRO a bf16 model trained through MasterCopy); zero: 0 (a plain
// optimizer), 2, 3 (whole model), 33 (units), 34 (units without prefetch), 35 (units
// stepped in backward, frugal's optimizers), 36 (units, each rank's ranges in 8 bits,
// frugal's optimizers) or 37 (36 stepped in backward).
inline Run train(const std::string& mode, int zero, const std::shared_ptr<Group>& group) {
  // Peaks count from here: a rank trains several runs and keeps each one's results.
  const std::int64_t before = frugal::MemoryProbe(torch::kCPU).allocated();
  torch::manual_seed(7);
  const auto x = torch::randn({kSteps + 1, kGlobal, 8});
  const auto y = torch::randint(0, 4, {kSteps + 1, kGlobal});
  // DataParallel and ZeRO-3 start from rank 0's weights; a MasterCopy's float32 weights
  // are its own rank's, so under bf16w every rank starts from the same ones.
  torch::manual_seed(mode == "bf16w" ? 8 : 8 + group->rank());
  UnitNet model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  auto make = [mode, zero](std::vector<torch::Tensor> p) {
    return make_inner(mode, std::move(p), zero >= 35);
  };
  if (zero == 0 && mode == "bf16w") {
    optimizer = std::make_unique<MasterCopy>(model->parameters(), torch::kBFloat16, make);
  } else if (zero == 0) {
    optimizer = make(model->parameters());
  } else {
    auto options = ZeroOptimizerOptions().stage(std::min(zero, 3)).gather_bytes(4096);
    if (zero > 3) {
      options.units(model->blocks->children())
          .prefetch(zero != 34)
          .step_in_backward(zero == 35 || zero == 37)
          .int8_ranges(zero >= 36);
    }
    if (mode == "bf16w") {
      options.param_dtype(torch::kBFloat16);
    }
    optimizer = std::make_unique<ZeroOptimizer>(model->parameters(), group, make, options);
  }
  auto trainer_options = frugal::TrainerOptions();
  if (mode == "micro") {
    trainer_options.micro_batch(3).accumulate(2);
  }
  frugal::Trainer trainer(model, *optimizer, cross_entropy, trainer_options);
  Run run;
  {
    const frugal::MemoryProbe probe(torch::kCPU);
    const auto start = probe.allocated();
    frugal::ScopedPeak setup(probe);
    trainer.add_policy(std::make_shared<frugal::distributed::DataParallel>(
        group, frugal::distributed::DataParallelOptions().bucket_bytes(8192)));
    run.setup_peak = setup.end() - start;
  }
  if (mode == "micro") {
    trainer.add_policy(
        std::make_shared<frugal::CheckpointPolicy>(frugal::CheckpointSelect().types({"Block"})));
    trainer.add_policy(std::make_shared<frugal::LeakGuard>());
  }
  if (mode == "bf16" || mode == "bf16w") {
    frugal::use_mixed_precision(trainer, torch::kBFloat16);
  }
  frugal::StepContext* in_forward = nullptr;
  frugal::StepContext* last_step = nullptr;  // the step running now
  trainer.add_hook(frugal::Phase::BeforeForward, [&](frugal::StepContext& c) {
    in_forward = &c;
    last_step = &c;
  });
  trainer.add_hook(frugal::Phase::AfterForward, [&](frugal::StepContext& c) {
    in_forward = nullptr;
    const auto ledger = frugal::measure_ledger(c.probe, c.module, &c.optimizer);
    run.weights_after_forward = ledger.weights;
    run.rest_after_forward = ledger.other - before;
  });
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext& c) {
    const auto ledger = frugal::measure_ledger(c.probe, c.module, &c.optimizer);
    run.weights_at_step = ledger.weights;
    run.gradients_at_step = std::max(run.gradients_at_step, ledger.gradients);
  });
  bool in_backward = false;  // a checkpointed block's forward runs again in backward
  trainer.add_hook(frugal::Phase::BeforeBackward,
                   [&](frugal::StepContext&) { in_backward = true; });
  trainer.add_hook(frugal::Phase::AfterBackward,
                   [&](frugal::StepContext&) { in_backward = false; });
  g_block_seen = [&](bool backward) {
    auto& most = backward || in_backward ? run.whole_in_backward : run.whole_in_forward;
    most = std::max(most, model->whole_blocks());
    if (backward && in_forward == nullptr && last_step != nullptr) {
      const auto& c = *last_step;
      run.gradients_in_backward =
          std::max(run.gradients_in_backward,
                   frugal::measure_ledger(c.probe, c.module, &c.optimizer).gradients);
    }
    if (!backward && !in_backward && in_forward != nullptr) {
      const auto& c = *in_forward;
      run.weights_in_forward = std::max(
          run.weights_in_forward, frugal::measure_ledger(c.probe, c.module, &c.optimizer).weights);
    }
  };
  const auto share = frugal::distributed::share_of(kGlobal, group->rank(), group->size());
  const std::int64_t parts = trainer_options.accumulate();
  for (std::int64_t s = 0; s < kSteps; ++s) {
    for (std::int64_t k = 0; k < parts; ++k) {
      const auto from = share.start + k * share.length / parts;
      const auto to = share.start + (k + 1) * share.length / parts;
      const auto report = trainer.step({x[s].slice(0, from, to), y[s].slice(0, from, to)});
      run.losses.push_back(report.loss);
      run.peak = std::max(run.peak, report.peak - before);
      run.weights_between = report.ledger.weights;
    }
  }
  g_block_seen = nullptr;
  last_step = nullptr;
  run.eval_loss = trainer.evaluate({x[kSteps], y[kSteps]}).loss;
  std::unique_ptr<frugal::optim::GatheredParameters> whole;
  if (auto* sharded = dynamic_cast<frugal::optim::ShardedOptimizer*>(optimizer.get())) {
    whole = std::make_unique<frugal::optim::GatheredParameters>(*sharded);
  }
  for (const auto& p : model->parameters()) {
    run.weights.push_back(p.detach().clone());
  }
  return run;
}

inline std::int64_t parameter_elements(const Run& run) {
  std::int64_t n = 0;
  for (const auto& w : run.weights) {
    n += w.numel();
  }
  return n;
}

inline void expect_same_training(const Run& got, const Run& want, double tolerance) {
  ASSERT_EQ(got.weights.size(), want.weights.size());
  for (std::size_t i = 0; i < want.weights.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got.weights[i], want.weights[i], tolerance, tolerance))
        << "parameter " << i << " differs by "
        << (got.weights[i] - want.weights[i]).abs().max().item<float>();
  }
  EXPECT_NEAR(got.eval_loss, want.eval_loss, tolerance);
}
inline std::vector<torch::Tensor> as_tensors(const Run& run) {
  auto out = run.weights;
  out.push_back(torch::tensor(run.losses, torch::kDouble));
  out.push_back(torch::tensor({run.weights_after_forward, run.weights_at_step, run.weights_between,
                               run.peak, run.whole_in_forward, run.whole_in_backward,
                               run.weights_in_forward, run.rest_after_forward, run.setup_peak,
                               run.gradients_at_step, run.gradients_in_backward}));
  out.push_back(torch::tensor({run.eval_loss}, torch::kDouble));
  return out;
}

// Building a ZeroOptimizer over `model` with `options` fails with an error holding `text`.
inline void expect_refused(UnitNet& model, const ZeroOptimizerOptions& options,
                           const std::string& text) {
  try {
    ZeroOptimizer zero(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> p) { return make_inner("sgd", std::move(p)); }, options);
    FAIL() << "accepted; wanted an error saying: " << text;
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// A child of this binary, `name`, that trains each of `runs` (mode, zero) on its rank and
// saves what as_tensors makes of them, in order.
inline RegisterChild register_training(const std::string& name,
                                       std::vector<std::pair<std::string, int>> runs) {
  return RegisterChild(name, [runs](const std::vector<std::string>& args) {
    return train_rank_and_save(args, [&runs](const std::shared_ptr<Group>& group) {
      std::vector<torch::Tensor> out;
      for (const auto& [mode, zero] : runs) {
        for (auto& t : as_tensors(train(mode, zero, group))) {
          out.push_back(std::move(t));
        }
      }
      return out;
    });
  });
}

}  // namespace frugal::testing::zero_units
