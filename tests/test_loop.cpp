// frugal::Loop, the user's own loop: a GAN's two models and optimizers in one loop, bit for
// bit with the hand-written LibTorch loop; exact accumulation; one scaler over several
// optimizers; gradients that never leak into a model that is not being trained.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <vector>

#include "compat.h"
#include "frugal/loop/loop.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/policy/grad_scaler.h"
#include "helpers.h"

namespace {
namespace loop {  // helper names of its own in the unity build

namespace F = torch::nn::functional;

constexpr std::int64_t kLatent = 6;

torch::nn::Sequential generator() {
  return torch::nn::Sequential(torch::nn::Linear(kLatent, 16), torch::nn::BatchNorm1d(16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 10));
}

// The discriminator's hidden block.
struct HiddenImpl : torch::nn::Module {
  HiddenImpl()
      : fc(register_module("fc", torch::nn::Linear(10, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::leaky_relu(bn(fc(x)), 0.2); }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
};
TORCH_MODULE(Hidden);

// The discriminator, its hidden block optionally checkpointed (recomputed in backward).
torch::nn::Sequential discriminator(bool checkpointed) {
  torch::nn::Sequential d;
  if (checkpointed) {
    d->push_back(frugal::nn::Checkpoint(Hidden()));
  } else {
    d->push_back(Hidden());
  }
  d->push_back(torch::nn::Linear(16, 1));
  return d;
}

torch::Tensor bce(const torch::Tensor& logits, double target) {
  return F::binary_cross_entropy_with_logits(logits, torch::full_like(logits, target));
}

struct Gan {
  torch::nn::Sequential g, d;
  std::unique_ptr<torch::optim::Adam> g_opt, d_opt;
  torch::Tensor data;

  explicit Gan(bool checkpointed) {
    torch::manual_seed(31);
    g = generator();
    d = discriminator(checkpointed);
    g_opt = std::make_unique<torch::optim::Adam>(
        g->parameters(), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}));
    d_opt = std::make_unique<torch::optim::Adam>(
        d->parameters(), torch::optim::AdamOptions(2e-3).betas({0.5, 0.999}));
    data = torch::randn({64, 10}) * 0.5 + 1.0;
  }
  torch::Tensor real(int i) const { return data.narrow(0, (i % 4) * 16, 16); }
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> out;
    for (const auto& m : {g.ptr(), d.ptr()}) {
      for (const auto& t : m->parameters()) {
        out.push_back(t.detach().clone());
      }
      for (const auto& t : m->buffers()) {
        out.push_back(t.clone());
      }
    }
    return out;
  }
};

struct Losses {
  std::vector<double> d, g;
};

void release(torch::nn::Module& m) {
  for (auto& p : m.parameters()) {
    p.mutable_grad().reset();
  }
}

// The DCGAN loop as a LibTorch program writes it: one generator forward per iteration, its
// output detached for the discriminator's step and not for the generator's.
Losses hand_loop(Gan& gan, int iterations) {
  torch::manual_seed(32);  // the noise stream
  Losses out;
  for (int i = 0; i < iterations; ++i) {
    auto fake = gan.g->forward(torch::randn({16, kLatent}));
    release(*gan.d);
    auto real_loss = bce(gan.d->forward(gan.real(i)), 1.0);
    real_loss.backward();
    auto fake_loss = bce(gan.d->forward(fake.detach()), 0.0);
    fake_loss.backward();
    gan.d_opt->step();
    release(*gan.g);
    auto g_loss = bce(gan.d->forward(fake), 1.0);
    g_loss.backward();
    gan.g_opt->step();
    out.d.push_back(real_loss.item<double>() + fake_loss.item<double>());
    out.g.push_back(g_loss.item<double>());
  }
  return out;
}

Losses frugal_loop(Gan& gan, int iterations, frugal::LoopOptions options = {}) {
  frugal::Loop loop(std::move(options));
  auto& d = loop.prepare(gan.d, *gan.d_opt, "discriminator");
  auto& g = loop.prepare(gan.g, *gan.g_opt, "generator");
  torch::manual_seed(32);  // the noise stream
  Losses out;
  for (int i = 0; i < iterations; ++i) {
    auto fake = gan.g->forward(torch::randn({16, kLatent}));
    loop.backward(bce(gan.d->forward(gan.real(i)), 1.0), d);
    loop.backward(bce(gan.d->forward(fake.detach()), 0.0), d);
    loop.step(d);
    loop.backward(bce(gan.d->forward(fake), 1.0), g);
    loop.step(g);
    const auto report = loop.end();
    out.d.push_back(report.model("discriminator").loss);
    out.g.push_back(report.model("generator").loss);
  }
  return out;
}

void expect_same_state(const Gan& a, const Gan& b) {
  const auto x = a.state();
  const auto y = b.state();
  ASSERT_EQ(x.size(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(torch::equal(x[i], y[i])) << "tensor " << i;
  }
}

std::int64_t batches_tracked(torch::nn::Module& m) {
  for (const auto& b : m.named_buffers()) {
    if (b.key().find("num_batches_tracked") != std::string::npos) {
      return b.value().item<std::int64_t>();
    }
  }
  return -1;
}

// Trains the GAN by hand and in a Loop (the discriminator's block checkpointed or not) for
// `iterations`: the same losses and the same state, bit for bit. Returns the Loop's GAN.
std::unique_ptr<Gan> expect_gan_matches_hand_loop(int iterations, bool checkpoint) {
  Gan hand(false);
  auto ours = std::make_unique<Gan>(checkpoint);
  const auto expected = hand_loop(hand, iterations);
  const auto got = frugal_loop(*ours, iterations);
  EXPECT_EQ(got.d, expected.d);
  EXPECT_EQ(got.g, expected.g);
  expect_same_state(*ours, hand);
  return ours;
}

TEST(Loop, GanMatchesTheHandWrittenLoopBitForBit) {
  constexpr int kIterations = 200;
  const auto ours = expect_gan_matches_hand_loop(kIterations, false);
  // BatchNorm counted one generator forward and three discriminator forwards an iteration.
  EXPECT_EQ(batches_tracked(*ours->g), kIterations);
  EXPECT_EQ(batches_tracked(*ours->d), 3 * kIterations);
}

TEST(Loop, GanWithACheckpointedDiscriminatorBlockStaysBitForBit) {
  constexpr int kIterations = 50;
  const auto ours = expect_gan_matches_hand_loop(kIterations, true);
  EXPECT_EQ(batches_tracked(*ours->d), 3 * kIterations);  // the recompute counts nothing
}

TEST(Loop, TheGeneratorsLossLeavesNoGradientOnTheDiscriminator) {
  Gan gan(false);
  frugal::Loop loop;
  auto& d = loop.prepare(gan.d, *gan.d_opt, "discriminator");
  auto& g = loop.prepare(gan.g, *gan.g_opt, "generator");
  loop.backward(bce(gan.d->forward(gan.real(0)), 1.0), d);
  loop.step(d);
  auto fake = gan.g->forward(torch::randn({16, kLatent}));
  loop.backward(bce(gan.d->forward(fake), 1.0), g);
  for (const auto& p : gan.d->parameters()) {
    EXPECT_FALSE(p.grad().defined());
  }
  for (const auto& p : gan.g->parameters()) {
    EXPECT_TRUE(p.grad().defined());
  }
  const auto report = (loop.step(g), loop.end());
  EXPECT_EQ(report.ledger.gradients, 0);  // both stepped: every gradient released
  EXPECT_EQ(report.model("discriminator").steps, 1);
  EXPECT_EQ(report.model("generator").backwards, 1);
}

TEST(Loop, AccumulateOverMicroBatchesGivesTheWholeBatchsGradient) {
  auto run = [](c10::optional<std::int64_t> micro) {
    torch::manual_seed(41);
    torch::nn::Linear model(5, 3);
    torch::optim::SGD sgd(model->parameters(), 0.1);
    frugal::Loop loop(frugal::LoopOptions().micro_batch(micro));
    auto& m = loop.prepare(model, sgd, "model");
    const frugal::Batch batch{torch::randn({10, 5}), torch::randint(3, {10})};
    const double mean = loop.accumulate(batch, m, [&](const frugal::Batch& b) {
      return F::cross_entropy(model->forward(b.inputs), b.targets);
    });
    auto grads = frugal::testing::grads_of(*model);
    return std::make_pair(mean, grads);
  };
  const auto whole = run(c10::nullopt);
  const auto micro = run(3);  // 3 + 3 + 3 + 1: unequal shares
  EXPECT_NEAR(micro.first, whole.first, 1e-6);
  frugal::testing::expect_all_close(micro.second, whole.second);
}

TEST(Loop, OneScalerOverTwoOptimizersSkipsBothOnAnInfAndHalvesOnce) {
  Gan gan(false);
  auto scaler = std::make_shared<frugal::GradScaler>(frugal::GradScalerOptions().init_scale(1024));
  frugal::Loop loop(frugal::LoopOptions().scaler(scaler));
  auto& d = loop.prepare(gan.d, *gan.d_opt, "discriminator");
  auto& g = loop.prepare(gan.g, *gan.g_opt, "generator");
  auto iteration = [&](double factor) {
    auto fake = gan.g->forward(torch::randn({16, kLatent}));
    loop.backward(bce(gan.d->forward(gan.real(0)), 1.0) * factor, d);
    const bool d_stepped = loop.step(d);
    loop.backward(bce(gan.d->forward(fake), 1.0) * factor, g);
    const bool g_stepped = loop.step(g);
    return std::make_tuple(d_stepped, g_stepped, loop.end());
  };
  const auto [d1, g1, first] = iteration(1.0);
  EXPECT_TRUE(d1 && g1);
  EXPECT_EQ(first.scale, 1024);
  // Parameters only: the discriminator's BatchNorm statistics move with every forward.
  auto parameters = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& m : {gan.g.ptr(), gan.d.ptr()}) {
      for (const auto& p : m->parameters()) {
        out.push_back(p.detach().clone());
      }
    }
    return out;
  };
  const auto before = parameters();
  const auto [d2, g2, second] = iteration(std::numeric_limits<double>::infinity());
  EXPECT_FALSE(d2);
  EXPECT_FALSE(g2);
  EXPECT_TRUE(second.model("discriminator").skipped && second.model("generator").skipped);
  EXPECT_EQ(second.scale, 512);  // one backoff for the iteration, not one per optimizer
  const auto after = parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i])) << "parameter " << i;
  }
  const auto [d3, g3, third] = iteration(1.0);
  EXPECT_TRUE(d3 && g3);
  EXPECT_EQ(third.scale, 512);
  EXPECT_EQ(d.skipped_steps(), 1);
  EXPECT_EQ(g.steps(), 2);
}

TEST(Loop, ANonFiniteLossSkipsOnlyItsModelsStepWithoutAScaler) {
  Gan gan(false);
  frugal::Loop loop;
  auto& d = loop.prepare(gan.d, *gan.d_opt, "discriminator");
  auto& g = loop.prepare(gan.g, *gan.g_opt, "generator");
  auto fake = gan.g->forward(torch::randn({16, kLatent}));
  loop.backward(bce(gan.d->forward(fake.detach()), 0.0) * std::nan(""), d);
  EXPECT_FALSE(loop.step(d));
  loop.backward(bce(gan.d->forward(fake), 1.0), g);
  EXPECT_TRUE(loop.step(g));
  EXPECT_EQ(d.skipped_steps(), 1);
  EXPECT_EQ(g.steps(), 1);
}

struct FailingSgd : torch::optim::SGD {
  using SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override {
    if (fail) {
      throw std::runtime_error("device lost");
    }
    return SGD::step(std::move(closure));
  }
  bool fail = true;
};

TEST(Loop, AFailedStepLeavesTheModelItsOptimizerAndItsGradientsAsTheyWere) {
  torch::manual_seed(43);
  torch::nn::Linear model(4, 2);
  FailingSgd sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  frugal::Loop loop;
  auto& m = loop.prepare(model, sgd, "model");
  loop.backward(model->forward(torch::randn({3, 4})).pow(2).mean(), m);
  const auto weights = model->weight.detach().clone();
  const auto grad = model->weight.grad().clone();
  EXPECT_THROW(loop.step(m), std::runtime_error);
  EXPECT_TRUE(torch::equal(model->weight, weights));
  EXPECT_TRUE(torch::equal(model->weight.grad(), grad));
  EXPECT_TRUE(sgd.state().empty());
  sgd.fail = false;
  EXPECT_TRUE(loop.step(m));  // the kept gradients step now
  EXPECT_FALSE(torch::equal(model->weight, weights));
  EXPECT_EQ(m.steps(), 1);
}

TEST(Loop, MistakesAreNamed) {
  torch::nn::Linear a(2, 1), b(2, 1);
  torch::optim::SGD sa(a->parameters(), 0.1), sb(b->parameters(), 0.1);
  frugal::Loop loop, other;
  auto& ma = loop.prepare(a, sa, "a");
  frugal::testing::expect_error_contains([&] { loop.prepare(b, sa, "b"); },
                                         "its optimizer already trains 'a'");
  frugal::testing::expect_error_contains([&] { loop.prepare(b, sb, "a"); },
                                         "the name 'a' is taken");
  frugal::testing::expect_error_contains([&] { loop.step(ma); }, "step of 'a' before any backward");
  frugal::testing::expect_error_contains(
      [&] {
        loop.backward(a->forward(torch::ones({3, 2})), ma);
      },
      "needs a scalar loss");
  auto& mb = other.prepare(b, sb, "b");
  frugal::testing::expect_error_contains(
      [&] {
        loop.backward(b->forward(torch::ones({1, 2})).sum(), mb);
      },
      "a model another Loop prepared");
  frugal::testing::expect_error_contains([] { frugal::Loop(frugal::LoopOptions().micro_batch(0)); },
                                         "micro_batch must be >= 1, got 0");
}

}  // namespace loop
}  // namespace

namespace {

TEST(CudaLoop, BackwardsLaunchWithoutAHostReadAndTheStepReadsTheirLossesOnce) {
  FRUGAL_SKIP_WITHOUT_CUDA();  // always so where LibTorch has no CUDA
#ifdef FRUGAL_WITH_CUDA
  torch::manual_seed(3);
  auto net = torch::nn::Linear(8, 1);
  net->to(torch::kCUDA);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  frugal::Loop loop(frugal::LoopOptions().device(torch::kCUDA));
  auto& model = loop.prepare(net, adam, "net");
  const auto x = torch::randn({2, 16, 8}, torch::kCUDA);
  std::vector<torch::Tensor> losses;
  {
    // Any read back from the device throws: the losses wait on the GPU until the step.
    frugal::compat::CudaHostReadsForbidden forbidden;
    for (int i = 0; i < 2; ++i) {
      const auto loss = net->forward(x[i]).pow(2).mean();
      losses.push_back(loss.detach());
      loop.backward(loss, model);
    }
  }
  const double expected = losses[0].item<double>() + losses[1].item<double>();
  EXPECT_TRUE(loop.step(model));
  const auto report = loop.end();
  EXPECT_NEAR(report.models.at(0).loss, expected, 1e-6 * (1 + std::abs(expected)));
  // A NaN loss launched the same way is found at the step, which is skipped.
  {
    frugal::compat::CudaHostReadsForbidden forbidden;
    loop.backward(net->forward(x[0]).mean() * std::nan(""), model);
  }
  EXPECT_FALSE(loop.step(model));
  EXPECT_TRUE(std::isnan(loop.end().models.at(0).loss));
#endif
}

}  // namespace
