// What a new user meets first: LibTorch's loss functions as they are, batches of several
// named tensors, frugal's error types, byte sizes, token accuracy, and a probe that counts
// a model built before it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "children.h"
#include "frugal/frugal.h"
#include "helpers.h"

namespace {

namespace F = torch::nn::functional;
using frugal::testing::make_mlp;

TEST(FrontDoor, LibTorchLossFunctionsWithDefaultedOptionsAreAccepted) {
  torch::manual_seed(0);
  auto model = make_mlp(4, 8, 3);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  frugal::Trainer trainer(model, sgd, F::cross_entropy);
  const auto x = torch::randn({8, 4});
  const auto y = torch::randint(3, {8});
  const double expected = F::cross_entropy(model->forward(x), y).item<double>();
  EXPECT_NEAR(trainer.step({x, y}).loss, expected, 1e-6);
  frugal::Trainer mse(model, sgd, F::mse_loss);
  EXPECT_GT(mse.step({x, torch::randn({8, 3})}).loss, 0);
}

// A model as LibTorch's MNIST example writes it: a struct derived from Module, held by
// std::shared_ptr, whose forward returns log-probabilities for nll_loss.
struct PlainNet : torch::nn::Module {
  PlainNet() : fc(register_module("fc", torch::nn::Linear(4, 3))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::log_softmax(fc(x), 1); }
  torch::nn::Linear fc;
};

torch::Tensor absolute_error(const torch::Tensor& output, const torch::Tensor& targets) {
  return (output - targets).abs().mean();
}

TEST(FrontDoor, ASharedPtrToAModuleStructTrainsWithAtenAndFunctionalLosses) {
  torch::manual_seed(1);
  auto net = std::make_shared<PlainNet>();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  const auto x = torch::randn({6, 4});
  const auto y = torch::randint(3, {6});
  const double expected = torch::nll_loss(net->forward(x), y).item<double>();
  frugal::Trainer aten(net, sgd, torch::nll_loss);
  EXPECT_NEAR(aten.step({x, y}).loss, expected, 1e-6);
  frugal::Trainer functional(net, sgd, F::nll_loss);
  const double now = F::nll_loss(net->forward(x), y).item<double>();
  EXPECT_NEAR(functional.step({x, y}).loss, now, 1e-6);
  EXPECT_LT(now, expected);  // the first step trained the model the second one measured
  frugal::Trainer lambda(net, sgd, [](const torch::Tensor& o, const torch::Tensor& t) {
    return torch::nll_loss(o, t, {}, at::Reduction::Sum) / o.size(0);
  });
  EXPECT_GT(lambda.step({x, y}).loss, 0);
  const auto values = torch::randn({6, 3});
  frugal::Trainer function(net, sgd, absolute_error);
  EXPECT_NEAR(function.step({x, values}).loss,
              absolute_error(net->forward(x), values).item<double>(), 1e-6);
}

TEST(FrontDoor, StepReportsCarryMetricsCountedOnEachMicroBatchsOutput) {
  torch::manual_seed(2);
  auto model = make_mlp(4, 8, 3);
  torch::optim::SGD sgd(model->parameters(), 0.0);  // the model stays: the counts compare
  std::int64_t calls = 0;
  frugal::Trainer trainer(
      model, sgd, F::cross_entropy,
      frugal::TrainerOptions().micro_batch(3).metrics(
          [&](const torch::Tensor& logits, const frugal::Batch& b) {
            ++calls;
            EXPECT_FALSE(logits.requires_grad());
            return std::map<std::string, double>{
                {"correct", logits.argmax(1).eq(b.targets).sum().item<double>()},
                {"seen", static_cast<double>(b.size())}};
          }));
  const auto x = torch::randn({10, 4});
  const auto y = torch::randint(3, {10});
  const auto report = trainer.step({x, y});
  torch::NoGradGuard no_grad;
  const double correct = model->forward(x).argmax(1).eq(y).sum().item<double>();
  EXPECT_EQ(calls, 4);  // 3 + 3 + 3 + 1
  EXPECT_EQ(report.metrics.at("seen"), 10);
  EXPECT_EQ(report.metrics.at("correct"), correct);
  EXPECT_NE(report.to_json().find("\"metrics\":{\"correct\""), std::string::npos);
  EXPECT_NE(report.summary().find("| seen 10"), std::string::npos) << report.summary();
}

TEST(FrontDoor, AtenLossesAreCalledWithTheirDefaults) {
  const auto o = torch::randn({5, 3});
  const auto t = torch::randn({5, 3});
  EXPECT_TRUE(torch::equal(frugal::make_loss(torch::mse_loss)(o, t), torch::mse_loss(o, t)));
  EXPECT_TRUE(
      torch::equal(frugal::make_loss(torch::smooth_l1_loss)(o, t), torch::smooth_l1_loss(o, t)));
  const auto labels = torch::randint(3, {5});
  EXPECT_TRUE(torch::equal(frugal::make_loss(torch::cross_entropy_loss)(o, labels),
                           F::cross_entropy(o, labels)));
  // A function whose trailing parameters frugal does not know: asked for a lambda.
  using Custom = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, double);
  Custom custom = [](const torch::Tensor& a, const torch::Tensor& b, double) { return a - b; };
  frugal::testing::expect_error_contains([&] { frugal::make_loss(custom); }, "pass a lambda");
}

TEST(FrontDoor, LossWithDefaultsCallsFunctionalLossesWithDefaultOptions) {
  const auto o = torch::randn({5, 3});
  const auto labels = torch::randint(3, {5});
  EXPECT_TRUE(torch::equal(frugal::loss_with_defaults(F::cross_entropy)(o, labels),
                           F::cross_entropy(o, labels, F::CrossEntropyFuncOptions())));
  EXPECT_TRUE(torch::equal(frugal::loss_with_defaults(torch::nll_loss)(o, labels),
                           torch::nll_loss(o, labels)));
}

TEST(FrontDoor, TensorForwardKeepsTheModelAliveForHoldersAndSharedPointers) {
  static_assert(frugal::nn::is_module_holder_v<torch::nn::Linear>);
  static_assert(!frugal::nn::is_module_holder_v<std::shared_ptr<PlainNet>>);
  torch::manual_seed(2);
  const auto x = torch::randn({2, 4});
  std::function<torch::Tensor(const torch::Tensor&)> holder_forward, pointer_forward;
  torch::Tensor holder_expected, pointer_expected;
  {
    torch::nn::Linear linear(4, 3);
    auto net = std::make_shared<PlainNet>();
    holder_forward = frugal::nn::tensor_forward(linear);
    pointer_forward = frugal::nn::tensor_forward(net);
    holder_expected = linear(x).detach();
    pointer_expected = net->forward(x).detach();
  }
  // The models went out of scope here; the functions hold them.
  EXPECT_TRUE(torch::equal(holder_forward(x).detach(), holder_expected));
  EXPECT_TRUE(torch::equal(pointer_forward(x).detach(), pointer_expected));
}

// A model that takes two tensors: the values and a mask of those to use.
struct MaskedImpl : torch::nn::Module {
  MaskedImpl() : fc(register_module("fc", torch::nn::Linear(6, 2))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask) { return fc(x * mask); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Masked);

TEST(BatchFields, SliceEveryTensorAliasAndSayWhatIsMissing) {
  frugal::Batch b{torch::arange(12).reshape({6, 2}), torch::arange(6)};
  b.set("mask", torch::arange(18).reshape({6, 3})).set("positions", torch::arange(6) * 10);
  EXPECT_EQ(b.size(), 6);
  const auto part = b.slice(2, 3);
  EXPECT_TRUE(torch::equal(part.get("mask"), torch::arange(18).reshape({6, 3}).narrow(0, 2, 3)));
  EXPECT_TRUE(torch::equal(part.get("positions"), torch::tensor({20, 30, 40})));
  EXPECT_TRUE(torch::equal(part.targets, torch::tensor({2, 3, 4})));
  EXPECT_TRUE(part.has("mask"));
  EXPECT_FALSE(part.has("lengths"));
  try {
    (void)b.get("lengths");
    ADD_FAILURE() << "no error";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'lengths'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'mask', 'positions'"), std::string::npos) << e.what();
  }
  b.set("mask", torch::ones({5, 3}));
  try {
    (void)b.size();
    ADD_FAILURE() << "no error";
  } catch (const frugal::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'mask' hold 5"), std::string::npos) << e.what();
  }
}

TEST(BatchFields, AModelOfTwoInputsTrainsInMicroBatchesAsOnTheWholeBatch) {
  const auto x = torch::randn({10, 6});
  const auto y = torch::randint(2, {10});
  const auto mask = torch::rand({10, 6}).gt(0.3).to(torch::kFloat);
  frugal::Batch batch{x, y};
  batch.set("mask", mask);
  auto run = [&](std::int64_t micro) {
    torch::manual_seed(3);
    Masked model;
    torch::optim::SGD sgd(model->parameters(), 0.5);
    frugal::Trainer trainer(
        model.ptr(), sgd,
        [&](const frugal::Batch& b) { return model->forward(b.inputs, b.get("mask")); },
        [](const torch::Tensor& out, const frugal::Batch& b) {
          return F::cross_entropy(out, b.targets);
        },
        frugal::TrainerOptions().micro_batch(micro));
    std::vector<double> losses;
    for (int i = 0; i < 5; ++i) {
      losses.push_back(trainer.step(batch).loss);
    }
    const auto eval = trainer.evaluate(batch);
    EXPECT_GE(eval.accuracy, 0);  // class outputs: scored as with a plain forward
    EXPECT_EQ(eval.scored, 10);
    return std::make_pair(losses, model->fc->weight.clone());
  };
  const auto whole = run(10);
  const auto micro = run(3);  // 3 + 3 + 3 + 1
  for (std::size_t i = 0; i < whole.first.size(); ++i) {
    EXPECT_NEAR(micro.first[i], whole.first[i], 1e-6);
  }
  EXPECT_TRUE(torch::allclose(micro.second, whole.second, 1e-5, 1e-6));
}

TEST(FrontDoor, ErrorsAreFrugalErrorsWithoutABacktraceAndStillC10Errors) {
  auto model = make_mlp(4, 8, 2);
  torch::optim::SGD sgd(model->parameters(), 0.1);
  try {
    frugal::Trainer(model, sgd, F::mse_loss, frugal::TrainerOptions().micro_batch(0));
    ADD_FAILURE() << "no error";
  } catch (const frugal::Error& e) {
    EXPECT_EQ(std::string(e.what()), "frugal: micro_batch must be >= 1, got 0");
  }
  EXPECT_THROW(frugal::Trainer(model, sgd, F::mse_loss, frugal::TrainerOptions().accumulate(0)),
               c10::Error);
  EXPECT_THROW(frugal::Trainer(model, sgd, F::mse_loss, frugal::TrainerOptions().accumulate(0)),
               std::exception);
}

TEST(FrontDoor, ByteSizesAre64BitPastTwoGiB) {
  static_assert(frugal::GiB(4) == 4LL * 1024 * 1024 * 1024);
  static_assert(frugal::MiB(512) == 536870912LL);
  static_assert(frugal::KiB(3) == 3072);
  frugal::ScopedCpuCap cap(frugal::GiB(4));
  EXPECT_EQ(frugal::CountingAllocator::cap(), 4LL << 30);
}

TEST(FrontDoor, TokenAccuracyLeavesOutTheIgnoreIndex) {
  // Logits [2, 3, 4] whose argmax is position-dependent; targets with two ignored.
  auto logits = torch::zeros({2, 3, 4});
  const auto argmax = torch::tensor({{0, 1, 2}, {3, 3, 1}});
  logits.scatter_(2, argmax.unsqueeze(2), 1.0);
  const auto targets = torch::tensor({{0, 2, -100}, {3, -100, 1}});
  // hits among scored: (0,0) yes, (0,1) no, (1,0) yes, (1,2) yes: 3 of 4.
  struct FixedImpl : torch::nn::Module {
    explicit FixedImpl(torch::Tensor l)
        : w(register_parameter("w", torch::zeros({1}))), l(std::move(l)) {}
    torch::Tensor forward(const torch::Tensor& idx) { return l.index_select(0, idx) + w; }
    torch::Tensor w, l;
  };
  auto fixed = std::make_shared<FixedImpl>(logits);
  torch::optim::SGD sgd(fixed->parameters(), 0.1);
  frugal::Trainer trainer(
      fixed, sgd, [&](const frugal::Batch& b) { return fixed->forward(b.inputs); },
      [](const torch::Tensor& out, const frugal::Batch& b) {
        return F::cross_entropy(out.flatten(0, 1), b.targets.flatten());
      });
  const auto eval = trainer.evaluate({torch::arange(2), targets});
  EXPECT_EQ(eval.scored, 4);
  EXPECT_DOUBLE_EQ(eval.accuracy, 0.75);
}

int weights_before_probe(const std::vector<std::string>&) {
  // The program's first tensors are the model's; no probe exists yet.
  torch::nn::Linear model(256, 128);
  const std::int64_t weights = (256 * 128 + 128) * 4;
  frugal::MemoryProbe probe(torch::kCPU);
  const auto ledger = frugal::measure_ledger(probe, *model);
  if (ledger.weights != weights || ledger.other < 0 || probe.allocated() < weights) {
    std::fprintf(stderr, "weights %lld allocated %lld other %lld\n",
                 static_cast<long long>(ledger.weights), static_cast<long long>(probe.allocated()),
                 static_cast<long long>(ledger.other));
    return 1;
  }
  return 0;
}
const frugal::testing::RegisterChild register_weights("weights-before-probe", weights_before_probe);

TEST(FrontDoor, AModelBuiltBeforeTheFirstProbeIsCounted) {
  EXPECT_EQ(frugal::testing::run_child("weights-before-probe", {}), 0);
}

}  // namespace
