#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/memory/ledger.h"
#include "frugal/policy/leak_guard.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::make_mlp;
namespace F = torch::nn::functional;

using frugal::testing::mse;

frugal::Batch wide_batch(std::int64_t n) {
  torch::manual_seed(5);
  return {torch::randn({n, 64}), torch::randn({n, 8})};
}

TEST(TrainerMemory, FourMicroBatchesLowerThePeakByTheActivationsTheySave) {
  const auto batch = wide_batch(256);
  frugal::MemoryProbe probe(torch::kCPU);
  // Activation bytes of the full batch: what the forward leaves alive for backward.
  std::int64_t activations = 0;
  {
    auto model = make_mlp(64, 2048, 8);
    const auto before = probe.allocated();
    auto loss = mse(model->forward(batch.inputs), batch.targets);
    activations = probe.allocated() - before;
  }
  ASSERT_GT(activations, 0);

  auto peak_with = [&](frugal::TrainerOptions options) {
    auto model = make_mlp(64, 2048, 8);
    torch::optim::SGD sgd(model->parameters(), 0.01);
    frugal::Trainer trainer(model, sgd, mse, options);
    return trainer.step(batch).peak;
  };
  const auto full = peak_with(frugal::TrainerOptions());
  const auto micro = peak_with(frugal::TrainerOptions().micro_batches(4));
  // Four micro-batches keep a quarter of the activations alive at once: three quarters
  // saved in the ideal; at least half of that must show in the step's peak.
  const std::int64_t ideal = activations - activations / 4;
  EXPECT_GE(full - micro, ideal / 2)
      << "full " << full << " micro " << micro << " activations " << activations;
}

struct ZeroingRun {
  std::int64_t allocated_after = 0;  // relative to before the model existed
  std::int64_t grad_bytes = 0;       // gradients alive after the step
  bool grads_defined = false;
};

ZeroingRun run_with_set_to_none(bool set_to_none) {
  const auto batch = wide_batch(32);
  frugal::MemoryProbe probe(torch::kCPU);
  const auto base = probe.allocated();
  auto model = make_mlp(64, 256, 8);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  frugal::Trainer trainer(model, sgd, mse, frugal::TrainerOptions().set_to_none(set_to_none));
  trainer.step(batch);
  const auto report = trainer.step(batch);
  ZeroingRun run;
  run.allocated_after = report.memory.allocated - base;
  run.grad_bytes = report.ledger.gradients;
  for (const auto& p : model->parameters()) {
    run.grads_defined = run.grads_defined || p.grad().defined();
  }
  return run;
}

TEST(TrainerMemory, SetToNoneReleasesExactlyTheGradientBytes) {
  const auto none = run_with_set_to_none(true);
  const auto zero = run_with_set_to_none(false);
  EXPECT_FALSE(none.grads_defined);
  EXPECT_TRUE(zero.grads_defined);
  EXPECT_EQ(none.grad_bytes, 0);
  ASSERT_GT(zero.grad_bytes, 0);
  EXPECT_EQ(zero.allocated_after - none.allocated_after, zero.grad_bytes);
}

// A parameter that takes part in the first step only: with set_to_none its gradient is
// none afterwards and SGD's weight decay leaves it alone; a zero-filled gradient would not.
torch::Tensor branch_after_two_steps(bool set_to_none) {
  torch::manual_seed(11);
  auto trunk = torch::nn::Linear(4, 1);
  auto branch = torch::nn::Linear(4, 1);
  auto both = std::make_shared<torch::nn::Module>();
  both->register_module("trunk", trunk);
  both->register_module("branch", branch);
  torch::optim::SGD sgd(both->parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.5));
  int call = 0;
  frugal::Trainer trainer(
      both, sgd,
      [&](const frugal::Batch& b) {
        auto y = trunk->forward(b.inputs);
        if (call++ == 0) {
          y = y + branch->forward(b.inputs);
        }
        return y.pow(2).mean();
      },
      frugal::TrainerOptions().set_to_none(set_to_none));
  const frugal::Batch batch{torch::randn({8, 4}), {}};
  trainer.step(batch);
  const auto after_first = branch->weight.detach().clone();
  trainer.step(batch);
  return (branch->weight.detach() - after_first).abs().max();
}

TEST(TrainerMemory, ReportsCountABufferTheModuleReplacedBetweenSteps) {
  struct Net : torch::nn::Module {
    Net() : scale(register_buffer("scale", torch::ones({64}))) {
      fc = register_module("fc", torch::nn::Linear(64, 8));
    }
    torch::Tensor& scale;  // the registered tensor: assigning replaces the buffer
    torch::nn::Linear fc{nullptr};
  };
  frugal::MemoryProbe probe(torch::kCPU);
  auto net = std::make_shared<Net>();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(
      net, sgd, [net](const torch::Tensor& x) { return net->fc->forward(x * net->scale); }, mse);
  const auto batch = wide_batch(16);
  const auto first = trainer.step(batch).ledger;
  const auto allocated = probe.allocated();
  net->scale = torch::ones({64 * 100}).narrow(0, 0, 64);            // a view of a larger storage
  EXPECT_EQ(probe.allocated(), allocated - 4 * 64 + 4 * 64 * 100);  // the old one is freed
  const auto second = trainer.step(batch).ledger;
  EXPECT_EQ(second.weights, first.weights - 4 * 64 + 4 * 64 * 100);
  EXPECT_EQ(second.weights, frugal::measure_ledger(probe, *net).weights);
}

TEST(TrainerMemory, WeightDecaySkipsAParameterWhoseGradientIsNone) {
  EXPECT_EQ(branch_after_two_steps(true).item<double>(), 0.0);
  EXPECT_GT(branch_after_two_steps(false).item<double>(), 0.0);
}

TEST(LeakGuard, FiftyStepsKeepAllocatedFlat) {
  auto model = make_mlp(64, 128, 8);
  torch::optim::Adam adam(model->parameters(), 1e-3);
  frugal::Trainer trainer(model, adam, mse, frugal::TrainerOptions().micro_batch(8));
  auto guard = std::make_shared<frugal::LeakGuard>();
  trainer.add_policy(guard);
  std::vector<std::int64_t> after;
  for (int i = 0; i < 50; ++i) {
    const auto batch = wide_batch(32);
    after.push_back(trainer.step(batch).memory.allocated);
  }
  EXPECT_GE(guard->baseline(), 0);
  EXPECT_EQ(guard->growth(), 0);
  for (std::size_t i = 3; i < after.size(); ++i) {
    EXPECT_EQ(after[i], after[2]) << "step " << i + 1;
  }
}

TEST(LeakGuard, CatchesAHookThatKeepsTheLossTensor) {
  auto model = make_mlp(64, 128, 8);
  torch::optim::SGD sgd(model->parameters(), 0.01);
  frugal::Trainer trainer(model, sgd, mse);
  trainer.add_policy(std::make_shared<frugal::LeakGuard>());
  std::vector<torch::Tensor> kept;  // the classic leak: losses kept "for logging"
  trainer.add_hook(frugal::Phase::BeforeBackward,
                   [&](frugal::StepContext& c) { kept.push_back(c.loss); });
  const auto batch = wide_batch(32);
  int leaked_at = -1;
  std::int64_t growth = 0;
  for (int i = 0; i < 6 && leaked_at < 0; ++i) {
    try {
      trainer.step(batch);
    } catch (const frugal::LeakError& e) {
      leaked_at = i + 1;
      growth = e.growth();
      EXPECT_NE(std::string(e.what()).find("bytes"), std::string::npos);
    }
  }
  EXPECT_EQ(leaked_at, 4);  // warm-up 2, baseline at 3, caught at 4
  EXPECT_GT(growth, 0);
}

TEST(CudaTrainerMemory, SetToNoneReleasesTheGradientBytes) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  auto run = [](bool set_to_none) {
    auto model = make_mlp(64, 256, 8);
    model->to(torch::kCUDA);
    torch::optim::SGD sgd(model->parameters(), 0.01);
    frugal::Trainer trainer(model, sgd, mse,
                            frugal::TrainerOptions().set_to_none(set_to_none).device(torch::kCUDA));
    auto batch = wide_batch(32);
    trainer.step(batch);
    return trainer.step(batch);
  };
  const auto none = run(true);
  const auto zero = run(false);
  // The ledger counts each gradient's own bytes; the caching allocator hands out blocks of
  // whole 512-byte units, so the bias's 32 bytes hold 512.
  auto model = make_mlp(64, 256, 8);
  std::int64_t exact = 0, in_blocks = 0;
  for (const auto& p : model->parameters()) {
    exact += p.nbytes();
    in_blocks += frugal::testing::cuda_block_bytes(p.nbytes());
  }
  ASSERT_EQ(zero.ledger.gradients, exact);
  EXPECT_EQ(zero.memory.allocated - none.memory.allocated, in_blocks);
}

}  // namespace
