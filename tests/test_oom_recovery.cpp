#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>

#include "frugal/memory/counting_allocator.h"
#include "frugal/memory/memory_cap.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::clone_all;
using frugal::testing::expect_all_close;
namespace F = torch::nn::functional;

torch::Tensor ce(const torch::Tensor& o, const torch::Tensor& t) { return F::cross_entropy(o, t); }

std::vector<frugal::Batch> batches_of(std::int64_t n, int count, std::uint64_t seed = 4) {
  torch::manual_seed(seed);
  std::vector<frugal::Batch> out;
  for (int i = 0; i < count; ++i) {
    out.push_back({torch::randn({n, 256}), torch::randint(0, 10, {n}, torch::kLong)});
  }
  return out;
}

torch::nn::Sequential model() { return frugal::testing::deep_narrow(32); }

struct Run {
  std::vector<torch::Tensor> weights;
  std::vector<std::int64_t> allocated_after;  // above the baseline before the model
  std::vector<std::int64_t> retries;
  std::vector<std::int64_t> peaks;  // above the baseline
  std::int64_t final_micro_batch = 0;
};

// Five SGD steps on batches of 64. `cap_above` caps the counted bytes at the baseline plus
// that many (0: no cap).
Run train(std::int64_t micro_batch, std::int64_t cap_above, bool recover,
          std::int64_t accumulate = 1) {
  const auto batches = batches_of(64, 5);
  frugal::MemoryProbe probe(torch::kCPU);
  const auto base = probe.allocated();
  auto net = model();
  torch::optim::SGD sgd(net->parameters(), 0.05);
  auto options = frugal::TrainerOptions().accumulate(accumulate);
  if (micro_batch > 0) {
    options.micro_batch(micro_batch);
  }
  frugal::Trainer trainer(net, sgd, ce, options);
  if (recover) {
    trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  }
  std::unique_ptr<frugal::ScopedCpuCap> cap;
  if (cap_above > 0) {
    cap = std::make_unique<frugal::ScopedCpuCap>(base + cap_above);
  }
  Run run;
  for (const auto& b : batches) {
    const auto r = trainer.step(b);
    run.allocated_after.push_back(r.memory.allocated - base);
    run.retries.push_back(r.oom_retries);
    run.peaks.push_back(r.peak - base);
  }
  trainer.flush();
  run.weights = clone_all(net->parameters());
  run.final_micro_batch = trainer.micro_batch();
  return run;
}

TEST(OomRecovery, CapBetweenMicroBatch16AndBatch64KeepsTheGradient) {
  const auto full = train(0, 0, false);
  const auto micro16 = train(16, 0, false);
  const auto peak16 = *std::max_element(micro16.peaks.begin(), micro16.peaks.end());
  const auto peak64 = *std::max_element(full.peaks.begin(), full.peaks.end());
  ASSERT_LT(peak16, peak64);
  const auto capped = train(0, (peak16 + peak64) / 2, true);
  EXPECT_GT(capped.retries.front(), 0);
  EXPECT_EQ(capped.final_micro_batch, 16);
  for (std::size_t i = 1; i < capped.retries.size(); ++i) {
    EXPECT_EQ(capped.retries[i], 0) << "step " << i + 1 << " kept the smaller micro-batch";
  }
  expect_all_close(capped.weights, micro16.weights, 1e-5, 1e-6);
  EXPECT_EQ(capped.allocated_after, micro16.allocated_after);  // the failed attempts left nothing
}

TEST(OomRecovery, FailureInsideAnAccumulationWindowKeepsTheWindowsGradients) {
  // With the policy present, a window's earlier gradients wait aside while its second
  // batch runs, so that batch peaks higher than the first: a cap between the two fails
  // the second batch only.
  const auto full = train(0, 0, true, /*accumulate=*/2);
  ASSERT_LT(full.peaks[0], full.peaks[1]);
  const auto capped = train(0, (full.peaks[0] + full.peaks[1]) / 2, true, 2);
  EXPECT_EQ(capped.retries[0], 0);
  EXPECT_GT(capped.retries[1], 0);
  // The window's first batch kept its gradient: the result is the uncapped run's.
  expect_all_close(capped.weights, full.weights, 1e-5, 1e-6);
}

TEST(OomRecovery, BelowMicroBatchOneGivesUpLeavingEverythingAsItWas) {
  const auto batches = batches_of(64, 2);
  frugal::MemoryProbe probe(torch::kCPU);
  auto net = model();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  frugal::Trainer trainer(net, sgd, ce);
  trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  trainer.step(batches[0]);  // momentum buffers exist
  const auto weights = clone_all(net->parameters());
  std::vector<torch::Tensor> momentum;
  for (const auto& e : sgd.state()) {
    momentum.push_back(
        static_cast<const torch::optim::SGDParamState&>(*e.second).momentum_buffer().clone());
  }
  const auto before = probe.allocated();
  {
    frugal::ScopedCpuCap cap(before + 64);  // not even one sample's activations fit
    try {
      trainer.step(batches[1]);
      FAIL() << "the step went through";
    } catch (const c10::OutOfMemoryError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("micro-batch 1 (the floor is 1)"), std::string::npos) << what;
      EXPECT_NE(what.find("cap"), std::string::npos) << what;
      EXPECT_NE(what.find("allocated"), std::string::npos) << what;
      // One backtrace at most, LibTorch's own for the error raised here; none carried over
      // from the allocator's error inside the message.
      const std::string message = e.what_without_backtrace();
      EXPECT_EQ(message.find("Exception raised from"), std::string::npos) << message;
    }
    EXPECT_EQ(probe.allocated(), before);
  }
  expect_all_close(clone_all(net->parameters()), weights, 0, 0);
  std::size_t i = 0;
  for (const auto& e : sgd.state()) {
    EXPECT_TRUE(
        torch::equal(static_cast<const torch::optim::SGDParamState&>(*e.second).momentum_buffer(),
                     momentum[i++]));
  }
  for (const auto& p : net->parameters()) {
    EXPECT_FALSE(p.grad().defined());
  }
}

TEST(OomRecovery, OomInEvaluateShrinksTheEvaluationBatchOnly) {
  torch::manual_seed(2);
  const frugal::Batch data{torch::randn({1000, 256}), torch::randint(0, 10, {1000}, torch::kLong)};
  frugal::MemoryProbe probe(torch::kCPU);
  auto net = model();
  torch::optim::SGD sgd(net->parameters(), 0.05);
  frugal::Trainer trainer(net, sgd, ce, frugal::TrainerOptions().micro_batch(32).eval_batch(1000));
  trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  const auto base = probe.allocated();
  const auto plain = trainer.evaluate(data);
  const auto quarter = trainer.evaluate(data, 250);
  ASSERT_LT(quarter.peak, plain.peak);
  frugal::EvalReport capped;
  {
    frugal::ScopedCpuCap cap(base + (quarter.peak - base + plain.peak - base) / 2);
    capped = trainer.evaluate(data);
  }
  EXPECT_GT(capped.oom_retries, 0);
  EXPECT_LT(trainer.eval_batch(), 1000);
  EXPECT_EQ(trainer.micro_batch(), 32);
  EXPECT_NEAR(capped.loss, plain.loss, 1e-6);
  EXPECT_DOUBLE_EQ(capped.accuracy, plain.accuracy);
}

TEST(OomRecovery, OtherErrorsAreNotRetried) {
  auto net = model();
  torch::optim::SGD sgd(net->parameters(), 0.05);
  int calls = 0;
  frugal::Trainer trainer(net, sgd, [&](const torch::Tensor& o, const torch::Tensor& t) {
    ++calls;
    TORCH_CHECK(false, "not an OOM");
    return ce(o, t);
  });
  trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  EXPECT_THROW(trainer.step(batches_of(8, 1)[0]), c10::Error);
  EXPECT_EQ(calls, 1);
}

#ifdef FRUGAL_WITH_CUDA
TEST(CudaOomRecovery, MemoryFractionBetweenMicroBatch16AndBatch64) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  // Large enough that the activations of a batch of 64 dominate the caching allocator.
  // The cap is the caching allocator's fraction, held by an object: an assertion that fails
  // inside the run cannot leave every later test on a smaller card.
  auto run = [](std::int64_t micro, std::int64_t cap_bytes) {
    torch::manual_seed(8);
    auto net = torch::nn::Sequential(torch::nn::Linear(4096, 16384), torch::nn::ReLU(),
                                     torch::nn::Linear(16384, 16384), torch::nn::ReLU(),
                                     torch::nn::Linear(16384, 10));
    net->to(torch::kCUDA);
    torch::optim::SGD sgd(net->parameters(), 0.01);
    auto options = frugal::TrainerOptions().device(torch::kCUDA);
    if (micro > 0) {
      options.micro_batch(micro);
    }
    frugal::Trainer trainer(net, sgd, ce, options);
    trainer.add_policy(std::make_shared<frugal::OomRecovery>());
    torch::manual_seed(3);
    const frugal::Batch b{torch::randn({8192, 4096}), torch::randint(0, 10, {8192}, torch::kLong)};
    std::optional<frugal::ScopedMemoryCap> cap;
    if (cap_bytes > 0) {
      cap.emplace(torch::kCUDA, cap_bytes);
    }
    const auto r = trainer.step(b);
    return std::make_pair(r, clone_all(net->parameters()));
  };
  frugal::MemoryProbe probe(torch::kCUDA);
  probe.empty_cache();
  const auto micro = run(1024, 0);
  const auto full = run(0, 0);
  probe.empty_cache();
  const auto capped = run(0, (micro.first.peak + full.first.peak) / 2);
  EXPECT_GT(capped.first.oom_retries, 0);
  EXPECT_LT(capped.first.micro_batch, 8192);
  for (std::size_t i = 0; i < capped.second.size(); ++i) {
    EXPECT_TRUE(torch::allclose(capped.second[i].cpu(), full.second[i].cpu(), 1e-4, 1e-5));
  }
}
#endif

}  // namespace
