// What a loss's reduction trains on: a mean over the batch's count, the unsplit batch's sum
// (PyTorch's reduction='sum'), or a sum over the batch's count, exact across micro-batches
// and accumulation windows, on both faces; and what the reports and evaluate say of it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "frugal/loop/loop.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {
namespace loss_reduction {  // helper names of its own in the unity build

namespace F = torch::nn::functional;
using frugal::LossReduction;
using frugal::testing::grads_of;

// A small autoencoder in float64 (so that sums of 128 samples compare to 1e-12) and a
// VAE-style loss: the squared error summed over the batch.
torch::nn::Sequential autoencoder() {
  auto net = frugal::testing::make_mlp(6, 4, 6, 41);
  net->to(torch::kDouble);
  return net;
}

torch::Tensor summed_error(const torch::Tensor& out, const torch::Tensor& target) {
  return F::mse_loss(out, target, F::MSELossFuncOptions().reduction(torch::kSum));
}

frugal::Batch data(std::int64_t n, std::uint64_t seed) {
  torch::manual_seed(seed);
  const auto x = torch::randn({n, 6}, torch::kDouble);
  return {x, x};
}

// The largest difference between `a` and `b`, relative to the largest of `b`.
double relative_gap(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double gap = 0;
  double scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    gap = std::max(gap, (a[i] - b[i]).abs().max().item<double>());
    scale = std::max(scale, b[i].abs().max().item<double>());
  }
  return gap / scale;
}

// The gradients of the summed loss over `batches` run as one batch, by a plain backward.
std::vector<torch::Tensor> unsplit_gradients(const std::vector<frugal::Batch>& batches) {
  auto net = autoencoder();
  std::vector<torch::Tensor> xs;
  for (const auto& b : batches) {
    xs.push_back(b.inputs);
  }
  const auto x = torch::cat(xs);
  summed_error(net->forward(x), x).backward();
  return grads_of(*net);
}

// The gradients a Trainer steps on, for `batches` under `options`.
std::vector<torch::Tensor> trainer_gradients(const std::vector<frugal::Batch>& batches,
                                             frugal::TrainerOptions options) {
  auto net = autoencoder();
  torch::optim::SGD sgd(net->parameters(), 0.0);
  frugal::Trainer trainer(net, sgd, summed_error, std::move(options));
  std::vector<torch::Tensor> seen;
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep,
                   [&](frugal::StepContext& c) { seen = grads_of(c.module); });
  for (const auto& b : batches) {
    trainer.step(b);
  }
  return seen;
}

TEST(LossReduction, SumTrainsOnTheUnsplitBatchsSummedLoss) {
  const auto batch = data(128, 1);
  const auto expected = unsplit_gradients({batch});
  const auto got = trainer_gradients(
      {batch}, frugal::TrainerOptions().micro_batch(32).reduction(LossReduction::Sum));
  EXPECT_LE(relative_gap(got, expected), 1e-12);
  // The mean reduction, given a summed loss, trains on a quarter of it (four micro-batches):
  // what the reduction is for.
  const auto mean = trainer_gradients({batch}, frugal::TrainerOptions().micro_batch(32));
  EXPECT_NEAR(mean[0].norm().item<double>() * 4, expected[0].norm().item<double>(),
              1e-9 * expected[0].norm().item<double>());
}

TEST(LossReduction, SumOverAnAccumulationWindowIsTheWindowsSum) {
  const std::vector<frugal::Batch> batches = {data(64, 2), data(48, 3)};
  const auto got = trainer_gradients(
      batches,
      frugal::TrainerOptions().micro_batch(32).accumulate(2).reduction(LossReduction::Sum));
  EXPECT_LE(relative_gap(got, unsplit_gradients(batches)), 1e-12);
}

TEST(LossReduction, SumOverCountDividesTheSumByTheBatchsCount) {
  const auto batch = data(128, 4);
  auto expected = unsplit_gradients({batch});
  for (auto& g : expected) {
    g /= 128;
  }
  const auto got = trainer_gradients(
      {batch}, frugal::TrainerOptions().micro_batch(32).reduction(LossReduction::SumOverCount));
  EXPECT_LE(relative_gap(got, expected), 1e-12);
}

TEST(LossReduction, AdamOnASummedLossTrainsAsThePlainProgram) {
  auto plain = autoencoder();
  torch::optim::Adam plain_adam(plain->parameters(), torch::optim::AdamOptions(1e-2));
  auto net = autoencoder();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  frugal::Trainer trainer(net, adam, summed_error,
                          frugal::TrainerOptions().micro_batch(32).reduction(LossReduction::Sum));
  for (int step = 0; step < 6; ++step) {
    const auto batch = data(128, 10 + step);
    plain_adam.zero_grad();
    const auto loss = summed_error(plain->forward(batch.inputs), batch.targets);
    loss.backward();
    plain_adam.step();
    const auto report = trainer.step(batch);
    // The report gives the loss per sample, as evaluate does (and pytorch/examples' VAE).
    EXPECT_NEAR(report.loss, loss.item<double>() / 128, 1e-9 * loss.item<double>());
  }
  EXPECT_LE(relative_gap(net->parameters(), plain->parameters()), 1e-9);
}

TEST(LossReduction, EvaluateOfASummedLossIsThePlainProgramsFigure) {
  const auto test_set = data(200, 5);
  auto net = autoencoder();
  torch::NoGradGuard no_grad;
  double total = 0;  // as the plain program sums its batches' losses, then divides
  for (std::int64_t start = 0; start < 200; start += 64) {
    const auto x = test_set.inputs.slice(0, start, std::min<std::int64_t>(start + 64, 200));
    total += summed_error(net->forward(x), x).item<double>();
  }
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, summed_error,
                          frugal::TrainerOptions().reduction(LossReduction::Sum));
  EXPECT_NEAR(trainer.evaluate(test_set, 64).loss, total / 200, 1e-12 * total);
}

TEST(LossReduction, TheLoopsAccumulateTrainsOnTheReductionItIsGiven) {
  const auto batch = data(128, 6);
  const auto expected = unsplit_gradients({batch});
  auto net = autoencoder();
  torch::optim::SGD sgd(net->parameters(), 0.0);
  frugal::Loop loop(frugal::LoopOptions().micro_batch(32).reduction(LossReduction::Sum));
  auto& model = loop.prepare(net, sgd, "autoencoder");
  const double loss = loop.accumulate(batch, model, [&](const frugal::Batch& micro) {
    return summed_error(net->forward(micro.inputs), micro.targets);
  });
  EXPECT_LE(relative_gap(grads_of(*net), expected), 1e-12);
  const auto x = batch.inputs;
  const double plain = summed_error(autoencoder()->forward(x), x).item<double>();
  EXPECT_NEAR(loss, plain / 128, 1e-12 * plain);  // per sample, as the Trainer reports it
  EXPECT_NEAR(loop.end().models.front().loss, plain / 128, 1e-12 * plain);
}

}  // namespace loss_reduction
}  // namespace
