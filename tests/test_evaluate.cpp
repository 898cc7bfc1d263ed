#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::make_mlp;
namespace F = torch::nn::functional;

frugal::Batch classification(std::int64_t n) {
  torch::manual_seed(9);
  return {torch::randn({n, 64}), torch::randint(0, 10, {n}, torch::kLong)};
}

TEST(Evaluate, PeakIsBelowTheTrainingForwardAndNoGraphIsBuilt) {
  // Deep enough that training keeps several activations alive for backward.
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(64, 512), torch::nn::Tanh(),
                              torch::nn::Linear(512, 512), torch::nn::Tanh(),
                              torch::nn::Linear(512, 512), torch::nn::Tanh(),
                              torch::nn::Linear(512, 10));
  torch::optim::SGD sgd(model->parameters(), 0.01);
  bool saw_grad = false;
  auto loss = [&](const torch::Tensor& out, const torch::Tensor& t) {
    saw_grad = saw_grad || out.requires_grad();
    return F::cross_entropy(out, t);
  };
  frugal::Trainer trainer(model, sgd, loss);
  const auto data = classification(256);
  const auto train = trainer.step(data);
  ASSERT_TRUE(saw_grad);
  saw_grad = false;
  const auto eval = trainer.evaluate(data, 256);
  EXPECT_FALSE(saw_grad);
  EXPECT_LT(eval.peak, train.forward_peak);
  EXPECT_TRUE(model->is_training());
  EXPECT_EQ(eval.samples, 256);
  EXPECT_EQ(eval.batches, 1);
}

TEST(Evaluate, MatchesAPlainComputationInBatches) {
  auto model = make_mlp(64, 32, 10);
  torch::optim::SGD sgd(model->parameters(), 0.01);
  frugal::Trainer trainer(model, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::cross_entropy(o, t);
  }, frugal::TrainerOptions().eval_batch(30).inference_mode(true));
  const auto data = classification(100);
  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = model->forward(data.inputs);
  }
  const double loss = F::cross_entropy(out, data.targets).item<double>();
  const double accuracy = out.argmax(1).eq(data.targets).to(torch::kDouble).mean().item<double>();
  const auto eval = trainer.evaluate(data);
  EXPECT_EQ(eval.batches, 4);  // 30 + 30 + 30 + 10
  EXPECT_NEAR(eval.loss, loss, 1e-5);
  EXPECT_DOUBLE_EQ(eval.accuracy, accuracy);
}

TEST(Evaluate, ADataLoaderOrAVectorOfBatchesGivesTheInMemoryReport) {
  auto model = make_mlp(64, 32, 10);
  torch::optim::SGD sgd(model->parameters(), 0.01);
  frugal::Trainer trainer(model, sgd, F::cross_entropy, frugal::TrainerOptions().eval_batch(16));
  const auto data = classification(100);
  const auto whole = trainer.evaluate(data);
  auto loader = torch::data::make_data_loader(
      torch::data::datasets::TensorDataset(data.inputs)
          .map(torch::data::transforms::Stack<torch::data::TensorExample>()),
      torch::data::DataLoaderOptions().batch_size(30));
  // The loader yields inputs only; a vector of batches carries the targets too.
  std::vector<frugal::Batch> batches;
  for (std::int64_t offset = 0; offset < 100; offset += 30) {
    batches.push_back(data.slice(offset, std::min<std::int64_t>(30, 100 - offset)));
  }
  const auto parts = trainer.evaluate(batches);
  EXPECT_EQ(parts.samples, 100);
  EXPECT_EQ(parts.batches, 7);  // 16 + 14 in each of three batches of 30, then 10
  EXPECT_NEAR(parts.loss, whole.loss, 1e-6);
  EXPECT_EQ(parts.scored, whole.scored);
  EXPECT_DOUBLE_EQ(parts.accuracy, whole.accuracy);
  std::int64_t seen = 0;
  frugal::Trainer inputs_only(model.ptr(), sgd, [&](const frugal::Batch& b) {
    seen += b.size();
    return model->forward(b.inputs).pow(2).mean();
  });
  const auto from_loader = inputs_only.evaluate(*loader);
  EXPECT_EQ(from_loader.samples, 100);
  EXPECT_EQ(seen, 100);
  EXPECT_EQ(from_loader.accuracy, -1);  // a loss of the batch alone: no classes to score
}

TEST(Evaluate, KeepsAnEvalModeModuleInEvalMode) {
  auto model = make_mlp(64, 32, 10);
  model->eval();
  torch::optim::SGD sgd(model->parameters(), 0.01);
  frugal::Trainer trainer(model, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::cross_entropy(o, t);
  });
  trainer.evaluate(classification(10));
  EXPECT_FALSE(model->is_training());
}

}  // namespace
