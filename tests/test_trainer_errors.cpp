#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::clone_all;
using frugal::testing::make_mlp;
namespace F = torch::nn::functional;

void expect_error_naming(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

using frugal::testing::mse;

TEST(TrainerErrors, BadOptionsNameTheValue) {
  auto model = make_mlp(4, 8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  expect_error_naming([&] { frugal::Trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(0)); },
                      "micro_batch must be >= 1, got 0");
  expect_error_naming([&] { frugal::Trainer(model, sgd, mse, frugal::TrainerOptions().accumulate(0)); },
                      "accumulate must be >= 1, got 0");
  expect_error_naming([&] { frugal::Trainer(model, sgd, mse, frugal::TrainerOptions().micro_batches(-2)); },
                      "got -2");
  expect_error_naming(
      [&] {
        frugal::Trainer(model, sgd, mse, frugal::TrainerOptions().micro_batch(4).micro_batches(2));
      },
      "not both");
}

// A failing step must leave parameters, gradients and optimizer state as they were.
class FailedStepLeavesStateAlone : public ::testing::Test {
 protected:
  void SetUp() override {
    model = make_mlp(4, 8, 2);
    sgd = std::make_unique<torch::optim::SGD>(model->parameters(),
                                              torch::optim::SGDOptions(0.1).momentum(0.9));
    trainer = std::make_unique<frugal::Trainer>(model, *sgd, mse);
    trainer->step({torch::randn({8, 4}), torch::randn({8, 2})});  // optimizer state exists
    weights = clone_all(model->parameters());
    momentum = momentum_buffers();
  }
  std::vector<torch::Tensor> momentum_buffers() {
    std::vector<torch::Tensor> out;
    for (const auto& entry : sgd->state()) {
      const auto& state = static_cast<const torch::optim::SGDParamState&>(*entry.second);
      out.push_back(state.momentum_buffer().clone());
    }
    return out;
  }
  void expect_unchanged() {
    frugal::testing::expect_all_close(clone_all(model->parameters()), weights, 0, 0);
    frugal::testing::expect_all_close(momentum_buffers(), momentum, 0, 0);
    for (const auto& p : model->parameters()) {
      EXPECT_FALSE(p.grad().defined());
    }
  }
  torch::nn::Sequential model{nullptr};
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<frugal::Trainer> trainer;
  std::vector<torch::Tensor> weights, momentum;
};

TEST_F(FailedStepLeavesStateAlone, EmptyBatch) {
  expect_error_naming([&] { trainer->step({torch::randn({0, 4}), torch::randn({0, 2})}); },
                      "empty (0 samples)");
  expect_unchanged();
}

TEST_F(FailedStepLeavesStateAlone, InputsAndTargetsOfDifferentSizes) {
  expect_error_naming([&] { trainer->step({torch::randn({8, 4}), torch::randn({6, 2})}); },
                      "inputs hold 8 samples but targets hold 6");
  expect_unchanged();
}

TEST_F(FailedStepLeavesStateAlone, ANamedTensorOfAnotherSize) {
  frugal::Batch batch{torch::randn({8, 4}), torch::randn({8, 2})};
  batch.set("mask", torch::ones({5}));
  expect_error_naming([&] { trainer->step(batch); },
                      "inputs hold 8 samples but 'mask' hold 5 (shapes [8, 4] and [5])");
  frugal::Batch fields_only;
  fields_only.set("tokens", torch::ones({3, 2})).set("mask", torch::ones({4}));
  expect_error_naming([&] { (void)fields_only.size(); },
                      "'tokens' hold 3 samples but 'mask' hold 4");
  frugal::Batch scalar{torch::randn({8, 4}), torch::tensor(1.0)};
  expect_error_naming([&] { trainer->step(scalar); },
                      "batch targets must have a sample dimension, got a 0-d tensor");
  expect_unchanged();
}

TEST_F(FailedStepLeavesStateAlone, LossThatIsNotAScalar) {
  frugal::Trainer unreduced(model, *sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return F::mse_loss(o, t, F::MSELossFuncOptions().reduction(torch::kNone));
  }, frugal::TrainerOptions().micro_batch(4));
  expect_error_naming([&] { unreduced.step({torch::randn({8, 4}), torch::randn({8, 2})}); },
                      "the loss must be a scalar, got a tensor of shape [4, 2]");
  expect_unchanged();
}

TEST_F(FailedStepLeavesStateAlone, LossThatFailsInTheSecondMicroBatch) {
  int calls = 0;
  frugal::Trainer failing(model, *sgd, [&](const torch::Tensor& o, const torch::Tensor& t) {
    TORCH_CHECK(++calls < 2, "second micro-batch refused");
    return F::mse_loss(o, t);
  }, frugal::TrainerOptions().micro_batch(4));
  expect_error_naming([&] { failing.step({torch::randn({8, 4}), torch::randn({8, 2})}); },
                      "second micro-batch refused");
  expect_unchanged();
}

TEST(TrainerErrors, NegativeCountIsNamed) {
  auto model = make_mlp(4, 8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, mse,
                          frugal::TrainerOptions().count([](const frugal::Batch&) { return -3; }));
  expect_error_naming([&] { trainer.step({torch::randn({8, 4}), torch::randn({8, 2})}); },
                      "returned -3");
}

}  // namespace
