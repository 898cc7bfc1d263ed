// A step completes, or leaves parameters, optimizer state and the trainer's counters as
// they were, or says which parameters it changed and halts the trainer.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "frugal/memory/counting_allocator.h"
#include "frugal/optim/adam.h"
#include "frugal/policy/grad_scaler.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/report/sink.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {

using frugal::testing::clone_all;
namespace F = torch::nn::functional;

torch::Tensor ce(const torch::Tensor& out, const torch::Tensor& target) {
  return F::cross_entropy(out, target);
}

// Six parameter tensors, so that a step failing midway has some to change and some not.
torch::nn::Sequential make_net() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(),
                               torch::nn::Linear(256, 256), torch::nn::ReLU(),
                               torch::nn::Linear(256, 10));
}

frugal::Batch batch_of(std::int64_t n, std::uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({n, 64}), torch::randint(0, 10, {n}, torch::kLong)};
}

std::unique_ptr<torch::optim::Optimizer> make_adam(bool frugal_adam, torch::nn::Module& net) {
  if (frugal_adam) {
    return std::make_unique<frugal::optim::Adam>(net.parameters(),
                                                  torch::optim::AdamOptions(1e-2));
  }
  return std::make_unique<torch::optim::Adam>(net.parameters(), torch::optim::AdamOptions(1e-2));
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) {
      return false;
    }
  }
  return a.size() == b.size();
}

TEST(StepGuarantee, AnOptimizerPhaseErrorDoesNotStopLaterSteps) {
  for (const std::int64_t accumulate : {1, 3}) {
    auto net = make_net();
    torch::optim::SGD sgd(net->parameters(), 0.1);
    frugal::Trainer trainer(net, sgd, ce, frugal::TrainerOptions().accumulate(accumulate));
    int calls = 0;
    trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext&) {
      if (calls++ == 0) {
        throw std::runtime_error("first optimizer phase fails");
      }
    });
    const auto before = clone_all(net->parameters());
    for (std::int64_t i = 0; i + 1 < accumulate; ++i) {
      trainer.step(batch_of(8, 100 + i));
    }
    EXPECT_THROW(trainer.step(batch_of(8, 200)), std::runtime_error);
    EXPECT_EQ(trainer.steps(), 0);
    EXPECT_TRUE(all_equal(clone_all(net->parameters()), before));
    // A new window from nothing: the reference steps on the same batches alone.
    auto ref = make_net();
    torch::optim::SGD ref_sgd(ref->parameters(), 0.1);
    frugal::Trainer reference(ref, ref_sgd, ce, frugal::TrainerOptions().accumulate(accumulate));
    frugal::StepReport last;
    for (std::int64_t i = 0; i < accumulate; ++i) {
      last = trainer.step(batch_of(8, 300 + i));
      reference.step(batch_of(8, 300 + i));
    }
    EXPECT_TRUE(last.stepped) << "accumulate " << accumulate;
    EXPECT_EQ(trainer.steps(), 1);
    EXPECT_TRUE(all_equal(clone_all(net->parameters()), clone_all(ref->parameters())))
        << "accumulate " << accumulate << ": the failed window's gradients leaked into the next";
  }
}

struct Peaks {
  std::int64_t backward = 0, step = 0;
};

// The same tensors alive as in a capped run below: the model, a copy of its weights.
Peaks measure(bool frugal_adam, const frugal::Batch& batch) {
  auto net = make_net();
  auto adam = make_adam(frugal_adam, *net);
  frugal::Trainer trainer(net, *adam, ce);
  const auto before = clone_all(net->parameters());
  const auto report = trainer.step(batch);
  return {std::max(report.forward_peak, report.backward_peak), report.peak};
}

// Caps between the backward's peak and the first Adam step's: the out-of-memory error comes
// from inside the optimizer step, wherever it stops.
void check_caps(bool frugal_adam) {
  frugal::MemoryProbe probe;
  const auto batch = batch_of(32, 5);
  const auto peaks = measure(frugal_adam, batch);
  ASSERT_GT(peaks.step, peaks.backward);
  int partial = 0, untouched = 0;
  constexpr int kCaps = 24;
  for (int k = 0; k < kCaps; ++k) {
    const std::int64_t cap = peaks.backward + (peaks.step - 1 - peaks.backward) * k / (kCaps - 1);
    auto net = make_net();
    auto adam = make_adam(frugal_adam, *net);
    frugal::Trainer trainer(net, *adam, ce);
    trainer.add_policy(std::make_shared<frugal::OomRecovery>());
    const auto before = clone_all(net->parameters());
    const auto names = net->named_parameters().keys();
    try {
      frugal::ScopedCpuCap scoped(cap);
      trainer.step(batch);
      ADD_FAILURE() << "cap " << cap << " below the step's peak " << peaks.step << " passed";
    } catch (const frugal::PartialStepError& e) {
      ++partial;
      const auto after = net->parameters();
      std::size_t changed = 0;
      for (std::size_t i = 0; i < after.size(); ++i) {
        const bool named = std::find(e.updated.begin(), e.updated.end(), names[i]) !=
                           e.updated.end();
        changed += named ? 1 : 0;
        if (!named) {
          EXPECT_TRUE(torch::equal(after[i], before[i])) << names[i] << " changed, not named";
        }
      }
      EXPECT_GT(changed, 0u);
      EXPECT_EQ(e.updated.size(), changed);
      const std::string count = "after changing " + std::to_string(changed) + " parameter(s)";
      EXPECT_NE(std::string(e.what()).find(count), std::string::npos) << e.what();
      EXPECT_FALSE(trainer.halted().empty());
      EXPECT_THROW(trainer.step(batch), c10::Error) << "a halted trainer stepped";
      trainer.accept_partial_update();
      EXPECT_TRUE(trainer.step(batch).stepped);
    } catch (const c10::OutOfMemoryError& e) {
      ++untouched;
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("out of memory in the optimizer step"), std::string::npos) << what;
      EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << "a backtrace: " << what;
      EXPECT_TRUE(all_equal(clone_all(net->parameters()), before)) << "cap " << cap;
      EXPECT_TRUE(adam->state().empty()) << "cap " << cap << ": state of a failed first step";
      EXPECT_EQ(trainer.steps(), 0);
      // Without the cap it steps as a trainer that never failed.
      const auto report = trainer.step(batch);
      EXPECT_TRUE(report.stepped);
      auto ref = make_net();
      auto ref_adam = make_adam(frugal_adam, *ref);
      frugal::Trainer reference(ref, *ref_adam, ce);
      reference.step(batch);
      EXPECT_TRUE(all_equal(clone_all(net->parameters()), clone_all(ref->parameters())));
    }
  }
  if (frugal_adam) {
    EXPECT_EQ(untouched, kCaps) << "frugal's Adam must be all-or-nothing at every cap";
  } else {
    // LibTorch's Adam creates and updates state one parameter at a time: some cap stops it
    // midway.
    EXPECT_GT(partial, 0);
  }
  EXPECT_EQ(partial + untouched, kCaps);
  ::testing::Test::RecordProperty("partial", partial);
}

TEST(StepGuarantee, LibTorchAdamOutOfMemoryIsUndoneOrNamesTheChangedParameters) {
  check_caps(false);
}

TEST(StepGuarantee, FrugalAdamOutOfMemoryLeavesEverythingAsItWas) { check_caps(true); }

TEST(StepGuarantee, GradScalerStepsAgainAfterAFailedOptimizerStep) {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, ce);
  trainer.add_policy(std::make_shared<frugal::GradScalerPolicy>(
      std::make_shared<frugal::GradScaler>(frugal::GradScalerOptions().init_scale(1024))));
  bool fail = true;
  trainer.add_hook(frugal::Phase::BeforeOptimizerStep, [&](frugal::StepContext&) {
    if (std::exchange(fail, false)) {
      throw std::runtime_error("fails once");
    }
  });
  EXPECT_THROW(trainer.step(batch_of(8, 1)), std::runtime_error);
  EXPECT_TRUE(trainer.step(batch_of(8, 2)).stepped);
  EXPECT_EQ(trainer.steps(), 1);
}

struct ThrowingSink : frugal::ReportSink {
  void write(const frugal::StepReport&) override { throw std::runtime_error("sink failed"); }
  void write(const frugal::EvalReport&) override {}
};

TEST(StepGuarantee, AnErrorAfterTheUpdateComesWithTheStepCounted) {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, ce);
  trainer.add_sink(std::make_shared<ThrowingSink>());
  const auto before = clone_all(net->parameters());
  EXPECT_THROW(trainer.step(batch_of(8, 1)), std::runtime_error);
  EXPECT_EQ(trainer.steps(), 1);
  EXPECT_FALSE(all_equal(clone_all(net->parameters()), before));
  EXPECT_THROW(trainer.step(batch_of(8, 2)), std::runtime_error);
  EXPECT_EQ(trainer.steps(), 2) << "the step after a sink error did not step";
}

}  // namespace
