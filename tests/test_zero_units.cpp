// ZeRO-3 units: each block's weights are whole only around its own forward and backward.
// One process here, and 2 and 3 ranks against one process (children of this binary).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>

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

namespace {

using frugal::distributed::Group;
using frugal::distributed::ZeroOptimizer;
using frugal::distributed::ZeroOptimizerOptions;

constexpr std::int64_t kWidth = 64;
constexpr std::int64_t kBlocks = 8;
constexpr std::int64_t kSteps = 20;
constexpr std::int64_t kGlobal = 32;

// Called at the start of every block's forward and when a block's input gradient is in.
std::function<void(bool backward)> g_block_seen;

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

torch::Tensor cross_entropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

// frugal's optimizers (`in_place`, which ZeRO's step in backward needs) or LibTorch's.
std::unique_ptr<torch::optim::Optimizer> make_inner(const std::string& mode,
                                                    std::vector<torch::Tensor> params,
                                                    bool in_place = false) {
  if (mode == "sgd" || mode == "bf16") {  // Adam would carry bf16's last bits on
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
// guard) or bf16 (autocast); zero: 0 (a plain optimizer), 2, 3 (whole model), 33 (units),
// 34 (units without prefetch) or 35 (units stepped in backward, frugal's optimizers).
Run train(const std::string& mode, int zero, const std::shared_ptr<Group>& group) {
  // Peaks count from here: a rank trains several runs and keeps each one's results.
  const std::int64_t before = frugal::MemoryProbe(torch::kCPU).allocated();
  torch::manual_seed(7);
  const auto x = torch::randn({kSteps + 1, kGlobal, 8});
  const auto y = torch::randint(0, 4, {kSteps + 1, kGlobal});
  torch::manual_seed(8 + group->rank());  // DataParallel and ZeRO-3 start from rank 0's
  UnitNet model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  auto make = [mode, zero](std::vector<torch::Tensor> p) {
    return make_inner(mode, std::move(p), zero == 35);
  };
  if (zero == 0) {
    optimizer = make(model->parameters());
  } else {
    auto options = ZeroOptimizerOptions().stage(std::min(zero, 3)).gather_bytes(4096);
    if (zero > 3) {
      options.units(model->blocks->children()).prefetch(zero != 34).step_in_backward(zero == 35);
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
  if (mode == "bf16") {
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

std::int64_t parameter_elements(const Run& run) {
  std::int64_t n = 0;
  for (const auto& w : run.weights) {
    n += w.numel();
  }
  return n;
}

void expect_same_training(const Run& got, const Run& want, double tolerance) {
  ASSERT_EQ(got.weights.size(), want.weights.size());
  for (std::size_t i = 0; i < want.weights.size(); ++i) {
    EXPECT_TRUE(torch::allclose(got.weights[i], want.weights[i], tolerance, tolerance))
        << "parameter " << i << " differs by "
        << (got.weights[i] - want.weights[i]).abs().max().item<float>();
  }
  EXPECT_NEAR(got.eval_loss, want.eval_loss, tolerance);
}

TEST(ZeroUnits, EachBlockIsWholeOnlyAroundItsOwnCallsInOneProcess) {
  const auto plain = train("micro", 0, Group::single());
  const auto units = train("micro", 33, Group::single());
  expect_same_training(units, plain, 1e-5);
  EXPECT_EQ(plain.whole_in_forward, kBlocks);
  EXPECT_EQ(units.whole_in_forward, 1);  // the block being called, no other
  EXPECT_GE(units.whole_in_backward, 1);
  EXPECT_LE(units.whole_in_backward, 2);  // the block in backward and the one just done
  // After the forward the root unit (embed, head) and the shard: the blocks are released.
  const std::int64_t all = parameter_elements(plain) * 4;
  const std::int64_t block = (kWidth * kWidth + kWidth) * 4;
  EXPECT_EQ(units.weights_after_forward, all + (all - kBlocks * block));
  // Inside a block's forward: that block, and the next one's prefetched weights.
  EXPECT_EQ(units.weights_in_forward, all + (all - kBlocks * block) + 2 * block);
  // One rank keeps its gradients on the parameters until the optimizer's step, which
  // releases the root unit; with more ranks it goes before (the tests below).
  EXPECT_EQ(units.weights_at_step, all + (all - kBlocks * block));
  EXPECT_EQ(units.weights_between, all);  // the shard alone (one rank: all of it)
}

TEST(ZeroUnits, UnitsSteppedInBackwardTrainAsOneProcessAndKeepNoGradientToTheStep) {
  const auto plain = train("micro", 0, Group::single());
  const auto at_end = train("micro", 33, Group::single());
  const auto in_backward = train("micro", 35, Group::single());
  expect_same_training(in_backward, plain, 1e-5);
  // Stepped at the end, the gradients of every parameter wait for the step; stepped in
  // backward, each unit's go when its last one is in, and none is left at the step.
  const std::int64_t all = parameter_elements(plain) * 4;
  EXPECT_EQ(at_end.gradients_at_step, all);
  EXPECT_EQ(in_backward.gradients_at_step, 0);
  EXPECT_LT(in_backward.peak, at_end.peak);
  // Without micro-batches (whose earlier backwards accumulate every gradient): the most
  // gradients alive in backward, a few blocks' against nearly all of them.
  const auto whole_batch_at_end = train("adam", 33, Group::single());
  const auto whole_batch = train("adam", 35, Group::single());
  const std::int64_t block = (kWidth * kWidth + kWidth) * 4;
  EXPECT_LE(whole_batch.gradients_in_backward, 2 * block);
  EXPECT_GE(whole_batch_at_end.gradients_in_backward, all - 2 * block);
  std::cout << "one process: step peak " << in_backward.peak << " B stepped in backward, "
            << at_end.peak << " B at the end; gradients alive in backward "
            << whole_batch.gradients_in_backward << " B against "
            << whole_batch_at_end.gradients_in_backward << " B\n";
}

TEST(ZeroUnits, StepInBackwardNeedsStage3AndOneOfFrugalsOptimizers) {
  UnitNet model;
  const std::vector<std::shared_ptr<torch::nn::Module>> blocks = model->blocks->children();
  try {
    ZeroOptimizer zero(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> p) { return make_inner("adam", std::move(p)); },
        ZeroOptimizerOptions().stage(3).units(blocks).step_in_backward(true));
    FAIL() << "LibTorch's Adam accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs one of frugal's optimizers"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("torch::optim::Adam"), std::string::npos) << e.what();
  }
  try {
    ZeroOptimizer zero(
        model->parameters(), Group::single(),
        [](std::vector<torch::Tensor> p) { return make_inner("adam", std::move(p), true); },
        ZeroOptimizerOptions().stage(2).step_in_backward(true));
    FAIL() << "stage 2 accepted";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs stage 3; got stage 2"), std::string::npos)
        << e.what();
  }
}

TEST(ZeroUnits, BadUnitsAreRefusedNamingThem) {
  UnitNet model;
  auto make = [](std::vector<torch::Tensor> p) { return make_inner("sgd", std::move(p)); };
  auto expect_error = [&](const ZeroOptimizerOptions& options, const std::string& text) {
    try {
      ZeroOptimizer zero(model->parameters(), Group::single(), make, options);
      FAIL() << "accepted; wanted an error saying: " << text;
    } catch (const frugal::Error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  const std::vector<std::shared_ptr<torch::nn::Module>> blocks = model->blocks->children();
  expect_error(ZeroOptimizerOptions().stage(2).units(blocks),
               "ZeRO units need stage 3; got 8 units at stage 2");
  expect_error(ZeroOptimizerOptions().stage(3).units({blocks[0], model->blocks.ptr()}),
               "share a parameter; units must not overlap");
  torch::nn::Linear stranger(2, 2);
  expect_error(ZeroOptimizerOptions().stage(3).units({stranger.ptr()}),
               "holds none of the optimizer's parameters");
}

// zero-units-train PREFIX: every rank trains each mode with units, adam also at stages 2
// and 3 without units, and bf16 also without ZeRO: a 20-step bf16 run of this deep model
// differs from one process by more than bf16's rounding of another summation order
// (up to 4e-3), so units are held to the same ranks without ZeRO.
const std::vector<std::pair<std::string, int>> kRuns{
    {"adam", 33}, {"sgd", 33}, {"micro", 33}, {"bf16", 33}, {"adam", 2},
    {"adam", 3},  {"bf16", 0}, {"adam", 34},  {"adam", 35}, {"micro", 35}};
constexpr std::size_t kBf16Plain = 6;

std::vector<torch::Tensor> as_tensors(const Run& run) {
  auto out = run.weights;
  out.push_back(torch::tensor(run.losses, torch::kDouble));
  out.push_back(torch::tensor({run.weights_after_forward, run.weights_at_step, run.weights_between,
                               run.peak, run.whole_in_forward, run.whole_in_backward,
                               run.weights_in_forward, run.rest_after_forward, run.setup_peak,
                               run.gradients_at_step, run.gradients_in_backward}));
  out.push_back(torch::tensor({run.eval_loss}, torch::kDouble));
  return out;
}

const frugal::testing::RegisterChild register_units(
    "zero-units-train", [](const std::vector<std::string>& args) {
      return frugal::testing::train_rank_and_save(args, [](const std::shared_ptr<Group>& group) {
        std::vector<torch::Tensor> out;
        for (const auto& [mode, zero] : kRuns) {
          for (auto& t : as_tensors(train(mode, zero, group))) {
            out.push_back(std::move(t));
          }
        }
        return out;
      });
    });

void expect_ranks_train_as_one_process(int world) {
  const auto ranks = frugal::testing::launch_and_load("zero-units-train", world);
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(world)) << "a rank failed";
  const std::size_t per_run = 2 * (kBlocks + 2) + 3;  // weights, losses, bytes, eval
  for (int r = 0; r < world; ++r) {
    std::vector<torch::Tensor> bytes;
    for (std::size_t k = 0; k < kRuns.size(); ++k) {
      const auto& [mode, zero] = kRuns[k];
      SCOPED_TRACE(mode + " at ZeRO " + std::to_string(zero) + ", rank " + std::to_string(r));
      auto one = train(mode, 0, Group::single());
      const auto* at = &ranks[r][k * per_run];
      if (mode == "bf16") {  // the same ranks without ZeRO
        const auto* plain = &ranks[r][kBf16Plain * per_run];
        one.weights.assign(plain, plain + one.weights.size());
        one.losses = std::vector<double>(
            plain[one.weights.size()].data_ptr<double>(),
            plain[one.weights.size()].data_ptr<double>() + plain[one.weights.size()].numel());
        one.eval_loss = plain[one.weights.size() + 2].item<double>();
      }
      Run got;
      got.weights.assign(at, at + one.weights.size());
      got.eval_loss = at[one.weights.size() + 2].item<double>();
      const double tolerance = 1e-5;
      expect_same_training(got, one, tolerance);
      if (mode != "micro") {
        EXPECT_TRUE(torch::allclose(at[one.weights.size()],
                                    torch::tensor(one.losses, torch::kDouble), tolerance,
                                    tolerance));
      }
      bytes.push_back(at[one.weights.size() + 1]);
      const auto b = bytes.back();
      const std::int64_t elements = parameter_elements(one);
      if (zero >= 3) {  // adding DataParallel gathers nothing (once it gathered the model)
        EXPECT_LT(b[8].item<std::int64_t>(), elements * 4 / world) << "bytes while it was added";
      }
      if (zero > 3) {
        EXPECT_EQ(b[4].item<std::int64_t>(), 1) << "blocks whole in a block's forward";
        EXPECT_LE(b[5].item<std::int64_t>(), 2) << "blocks whole in a block's backward";
        // Between steps and at the update: this rank's range of each unit (root, 8 blocks).
        const std::int64_t root = (8 * kWidth + kWidth) + (kWidth * 4 + 4);
        const std::int64_t block = kWidth * kWidth + kWidth;
        const std::int64_t shard =
            ((root + world - 1) / world + kBlocks * ((block + world - 1) / world)) * 4;
        EXPECT_EQ(b[1].item<std::int64_t>(), shard);
        EXPECT_EQ(b[2].item<std::int64_t>(), shard);
        EXPECT_LE(static_cast<double>(shard), (world == 2 ? 0.55 : 0.4) * elements * 4);
        // The root unit stays whole until the update: its flat buffer, N ranges, padded.
        const std::int64_t root_flat = world * ((root + world - 1) / world) * 4;
        EXPECT_EQ(b[0].item<std::int64_t>(), shard + root_flat);
        // Inside a block's forward: its flat buffer, and with prefetch the next block's too.
        const std::int64_t block_flat = world * ((block + world - 1) / world) * 4;
        EXPECT_EQ(b[6].item<std::int64_t>(), shard + root_flat + (zero != 34 ? 2 : 1) * block_flat);
      }
    }
    // After forward, autograd's saved views of the released blocks hold no bytes: the rest
    // is the activations, as at stage 3 of the whole model (one block would be 16 kB more).
    const std::int64_t rest = bytes[5][7].item<std::int64_t>();
    EXPECT_NEAR(bytes[0][7].item<std::int64_t>(), rest, 1024) << "with prefetch";
    EXPECT_NEAR(bytes[7][7].item<std::int64_t>(), rest, 1024) << "without prefetch";
    // Adam with units against stage 2 and against stage 3 of the whole model: lower peaks.
    const auto units_peak = bytes[0][3].item<std::int64_t>();
    EXPECT_LT(units_peak, bytes[4][3].item<std::int64_t>()) << "stage 2's peak, rank " << r;
    EXPECT_LT(units_peak, bytes[5][3].item<std::int64_t>()) << "stage 3's peak, rank " << r;
    EXPECT_LT(bytes[7][3].item<std::int64_t>(), bytes[4][3].item<std::int64_t>())
        << "stage 2's peak against units without prefetch, rank " << r;
    // Each unit stepped in backward as its gradients arrive, against the same units stepped
    // at the end: no rank holds its range of all the gradients at once.
    const auto& in_backward = bytes[8];
    EXPECT_LT(in_backward[3].item<std::int64_t>(), units_peak) << "step peak, rank " << r;
    EXPECT_LT(in_backward[10].item<std::int64_t>(), bytes[0][10].item<std::int64_t>())
        << "gradients when a block's input gradient was in, rank " << r;
    EXPECT_LT(in_backward[9].item<std::int64_t>(), bytes[0][9].item<std::int64_t>())
        << "gradients at the optimizer step, rank " << r;
    std::cout << "rank " << r << " of " << world << ": stepped in backward: peak "
              << in_backward[3].item<std::int64_t>() << " B, gradients in backward "
              << in_backward[10].item<std::int64_t>() << " B (" << bytes[0][10].item<std::int64_t>()
              << " B stepped at the end), at the step " << in_backward[9].item<std::int64_t>()
              << " B (" << bytes[0][9].item<std::int64_t>() << " B)\n";
    std::cout << "rank " << r << " of " << world << ": step peak " << units_peak
              << " B with units (" << bytes[7][3].item<std::int64_t>() << " B without prefetch), "
              << bytes[4][3].item<std::int64_t>() << " B at stage 2, "
              << bytes[5][3].item<std::int64_t>() << " B at stage 3 whole\n";
  }
}

TEST(ZeroUnits, TwoRanksTrainAsOneProcessWithOneBlockWholeAtATime) {
  expect_ranks_train_as_one_process(2);
}

TEST(ZeroUnits, ThreeRanksTrainAsOneProcessWithOneBlockWholeAtATime) {
  expect_ranks_train_as_one_process(3);
}

}  // namespace
