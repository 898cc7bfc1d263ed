#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/autocast_guard.h"
#include "frugal/checkpoint.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/train/trainer.h"
#include "helpers.h"
#include "residual_mlp.h"
#include "tiny_lm/model.h"

namespace {

namespace F = torch::nn::functional;

// The residual MLP of the checkpointing claim: 16 blocks, width 512, hidden 2048, GELU.
constexpr std::int64_t kBlocks = 16, kWidth = 512, kHidden = 2048;

frugal::Batch batch_of(std::int64_t n) {
  torch::manual_seed(1);
  return {torch::randn({n, kWidth}), torch::randint(0, 10, {n}, torch::kLong)};
}

frugal::StepReport step_of(bool checkpointed, const frugal::Batch& batch,
                           torch::Device device = torch::kCPU) {
  torch::manual_seed(0);
  auto net = models::make_residual_mlp(kBlocks, kWidth, kHidden, 10);
  net->to(device);
  torch::optim::SGD sgd(net->parameters(), 0.01);
  frugal::Trainer trainer(
      net, sgd,
      [](const torch::Tensor& o, const torch::Tensor& t) { return F::cross_entropy(o, t); },
      frugal::TrainerOptions().device(device));
  if (checkpointed) {
    trainer.add_policy(std::make_shared<frugal::CheckpointPolicy>(
        frugal::CheckpointSelect().types({"ResidualBlock"})));
  }
  return trainer.step(batch);
}

// Measured bytes of one block: what its forward keeps alive beyond its output (a), its
// output (x) and its gradients (g).
struct BlockBytes {
  std::int64_t activations = 0, output = 0, grads = 0;
};

BlockBytes measure_block(const frugal::Batch& batch) {
  frugal::MemoryProbe probe(torch::kCPU);
  models::ResidualBlock block(kWidth, kHidden);
  BlockBytes b;
  const auto before = probe.allocated();
  auto y = block->forward(batch.inputs);
  b.output = y.numel() * y.element_size();
  b.activations = probe.allocated() - before - b.output;
  for (const auto& p : block->parameters()) {
    b.grads += p.numel() * p.element_size();
  }
  return b;
}

TEST(CheckpointMemory, ForwardKeepsOnlyBlockInputsAtBatch128) {
  const auto batch = batch_of(128);
  const auto block = measure_block(batch);
  const auto plain = step_of(false, batch);
  const auto ckpt = step_of(true, batch);
  EXPECT_NEAR(plain.loss, ckpt.loss, 1e-5);
  // Checkpointed, the forward keeps each block's input only: all blocks' internal
  // activations are saved, but for the one being computed.
  const std::int64_t expected = (kBlocks - 1) * block.activations;
  EXPECT_GE(plain.forward_peak - ckpt.forward_peak, expected * 7 / 10)
      << "plain " << plain.forward_peak << " checkpointed " << ckpt.forward_peak
      << " block activations " << block.activations;
}

TEST(CheckpointMemory, StepPeakFallsAsPredictedWhereActivationsDominate) {
  // At batch 1024 the activations outweigh the gradients; at 128 the step's peak is the
  // gradients' at the end of backward, which checkpointing cannot lower.
  const auto batch = batch_of(1024);
  const auto b = measure_block(batch);
  // Backward walks the blocks from the last: after j blocks, j blocks' gradients exist and
  // the other N - j blocks still hold what their forward kept.
  std::int64_t plain_high = 0, ckpt_high = 0;
  for (std::int64_t j = 0; j <= kBlocks; ++j) {
    plain_high = std::max(plain_high, j * b.grads + (kBlocks - j) * (b.activations + b.output));
    ckpt_high = std::max(ckpt_high, j * b.grads + (kBlocks - j) * b.output + b.activations);
  }
  const std::int64_t expected = plain_high - ckpt_high;
  ASSERT_GT(expected, 0);
  const auto plain = step_of(false, batch);
  const auto ckpt = step_of(true, batch);
  EXPECT_GE(plain.peak - ckpt.peak, expected * 7 / 10)
      << "plain " << plain.peak << " checkpointed " << ckpt.peak << " expected saving " << expected;
  EXPECT_NEAR(plain.loss, ckpt.loss, 1e-5);
}

TEST(CudaCheckpointMemory, ForwardKeepsOnlyBlockInputsAtBatch128) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  const auto batch = batch_of(128);
  const auto block = measure_block(batch);  // the same tensors' bytes as on the CPU
  // cuBLAS keeps a workspace per handle and stream (32 MiB on Hopper) from its first call
  // on: a warm-up step creates it, so that both measured runs hold it throughout.
  (void)step_of(false, batch, torch::kCUDA);
  const auto plain = step_of(false, batch, torch::kCUDA);
  const auto ckpt = step_of(true, batch, torch::kCUDA);
  EXPECT_GE(plain.forward_peak - ckpt.forward_peak, (kBlocks - 1) * block.activations * 7 / 10)
      << "plain " << plain.forward_peak << " checkpointed " << ckpt.forward_peak;
}

// Every form of checkpointing gives back all it allocated once its output is gone, with or
// without a backward: nothing is held by the autograd node's own closure.
TEST(CheckpointMemory, EveryFormFreesItsOutputAndRngState) {
  frugal::MemoryProbe probe;
  torch::manual_seed(3);
  const auto x = torch::randn({256, 1024}, torch::requires_grad());
  torch::nn::Linear block(1024, 1024);
  auto wrapped = frugal::nn::Checkpoint(block);
  const auto params = frugal::CheckpointOptions().params(block->parameters());
  const std::vector<std::pair<const char*, std::function<torch::Tensor()>>> forms = {
      {"checkpoint(fn, x)",
       [&] {
         return frugal::checkpoint(
             [](const torch::Tensor& t) { return torch::dropout(t.exp(), 0.5, true); }, x);
       }},
      {"checkpoint(fn, options, x)",
       [&] {
         return frugal::checkpoint([&](const torch::Tensor& t) { return block->forward(t); },
                                   params, x);
       }},
      {"checkpoint of a tuple",
       [&] {
         return std::get<0>(frugal::checkpoint(
             [](const torch::Tensor& t) { return std::make_tuple(t.sin(), 2, t.cos()); }, x));
       }},
      {"checkpoint_tensors",
       [&] {
         return frugal::checkpoint_tensors(
             [](const std::vector<torch::Tensor>& in) {
               return std::vector<torch::Tensor>{in[0].tanh()};
             },
             {x})[0];
       }},
      {"nn::Checkpoint", [&] { return wrapped->forward(x); }},
  };
  for (const auto& [name, run] : forms) {
    for (const bool backward : {false, true}) {
      run().sum().backward();  // a first call creates what stays (the parameters' gradients)
      const auto before = probe.allocated();
      {
        auto y = run();
        EXPECT_GT(probe.allocated(), before) << name;
        if (backward) {
          y.sum().backward();
        }
      }
      EXPECT_EQ(probe.allocated(), before) << name << (backward ? " with" : " without")
                                           << " backward: the output or its RNG state leaked";
    }
  }
}

// tiny_lm's block checkpointed under bf16 autocast: its forward runs under no_grad, where
// LibTorch's Linear over a transposed [time, batch, dim] view is a batched matmul against one
// copy of the weight per time step. The block gives its layer a contiguous copy.
TEST(CheckpointMemory, TinyLmBlockUnderBf16AutocastCopiesNoWeightPerTimeStep) {
  constexpr std::int64_t kDim = 256, kSteps = 64, kBatch = 4;
  torch::manual_seed(4);
  tiny_lm::Block block(kDim, kDim / 32, 0.0);
  std::int64_t weight_bytes = 0, linear1_bytes = 0;
  for (const auto& item : block->named_parameters()) {
    const auto bytes = item.value().numel() * item.value().element_size();
    weight_bytes += bytes;
    if (item.key() == "layer.linear1.weight") {
      linear1_bytes = bytes;
    }
  }
  ASSERT_GT(linear1_bytes, 0);
  const auto x = torch::randn({kBatch, kSteps, kDim}, torch::requires_grad());
  const auto mask = torch::full({kSteps, kSteps}, -std::numeric_limits<float>::infinity()).triu(1);
  frugal::MemoryProbe probe;
  frugal::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
  const auto run = [&] {
    return frugal::checkpoint([&](const torch::Tensor& in) { return block->forward(in, mask); },
                              frugal::CheckpointOptions().params(block->parameters()), x);
  };
  (void)run();  // first calls create what stays (LibTorch's kernels' caches)
  const auto before = probe.allocated();
  frugal::ScopedPeak peak(probe);
  const auto y = run();
  const auto held = peak.end() - before;
  // Autocast's bf16 copies of the weights (half their float32 bytes) and the forward's own
  // tensors stay below twice the float32 weights; one bf16 copy of linear1's weight per time
  // step alone would be kSteps / 2 times linear1's float32 bytes (10.6 times all weights).
  EXPECT_LT(held, 2 * weight_bytes)
      << "the forward held " << held << " bytes; the block's float32 weights are " << weight_bytes
      << ", linear1's " << linear1_bytes;
  EXPECT_EQ(y.sizes(), x.sizes());
}

}  // namespace
