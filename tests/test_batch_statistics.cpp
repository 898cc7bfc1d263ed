// Micro-batches over BatchNorm layers: the trainer (and the Loop's accumulate) warns once
// naming them, refuses, goes on silently, or runs whole batches until memory forces a cut,
// as the batch_statistics option says.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "compat.h"
#include "frugal/loop/loop.h"
#include "frugal/policy/oom_recovery.h"
#include "frugal/train/trainer.h"
#include "helpers.h"

namespace {
namespace batch_statistics {  // helper names of its own in the unity build

namespace F = torch::nn::functional;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(51);
    features = register_module(
        "features", torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8)));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(features->forward(x))); }
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

const frugal::Batch kBatch{torch::randn({8, 4}), torch::randint(2, {8})};

std::vector<std::string> warnings_of(Net net, frugal::TrainerOptions options, int steps = 2) {
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(net, sgd, F::cross_entropy, std::move(options));
  frugal::compat::WarningCapture capture;
  for (int i = 0; i < steps; ++i) {
    trainer.step(kBatch);
  }
  return capture.messages;
}

TEST(BatchStatistics, MicroBatchesOverBatchNormWarnOnceNamingTheLayers) {
  const auto warnings = warnings_of(Net(), frugal::TrainerOptions().micro_batch(4));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("micro-batches of 4 samples"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("'features.1'"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("batch_statistics(Accept)"), std::string::npos) << warnings[0];
}

TEST(BatchStatistics, AcceptedOrUnsplitOrInEvalModeTheyAreSilent) {
  EXPECT_TRUE(warnings_of(Net(), frugal::TrainerOptions().micro_batch(4).batch_statistics(
                                     frugal::BatchStatistics::Accept))
                  .empty());
  EXPECT_TRUE(warnings_of(Net(), frugal::TrainerOptions()).empty());
  EXPECT_TRUE(warnings_of(Net(), frugal::TrainerOptions().micro_batch(8)).empty());
  Net frozen_statistics;
  frozen_statistics->features[1]->eval();  // running statistics only: per-sample exact
  EXPECT_TRUE(warnings_of(frozen_statistics, frugal::TrainerOptions().micro_batch(4)).empty());
}

TEST(BatchStatistics, RefusedTheStepFailsBeforeAnythingChanges) {
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(
      net, sgd, F::cross_entropy,
      frugal::TrainerOptions().micro_batch(4).batch_statistics(frugal::BatchStatistics::Refuse));
  const auto before = frugal::testing::clone_all(net->parameters());
  const auto buffers = frugal::testing::clone_all(net->buffers());
  frugal::testing::expect_error_contains([&] { trainer.step(kBatch); },
                                         "batch statistics of 1 layer(s): 'features.1'");
  EXPECT_EQ(trainer.steps(), 0);
  const auto after = net->parameters();
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(before[i], after[i]));
  }
  const auto after_buffers = net->buffers();
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(torch::equal(buffers[i], after_buffers[i]));  // no forward ran
  }
}

// What a trainer's steps leave: the report's micro-batch counts, the parameters and buffers.
struct Trained {
  std::vector<std::int64_t> micro_batches;
  std::vector<torch::Tensor> state;
  std::vector<std::string> warnings;
};

// `net` trained 3 steps on kBatch; with `oom_above`, a micro-batch larger than that many
// samples raises an out-of-memory error, and OomRecovery is added.
template <typename Model>
Trained train(Model net, frugal::TrainerOptions options, std::int64_t oom_above = 0) {
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Trainer trainer(
      net.ptr(), sgd, frugal::Trainer::BatchLossFn([&](const frugal::Batch& micro) {
        TORCH_CHECK_WITH(OutOfMemoryError, oom_above == 0 || micro.size() <= oom_above,
                         "out of memory (injected for ", micro.size(), " samples)");
        return F::cross_entropy(net->forward(micro.inputs), micro.targets);
      }),
      std::move(options));
  if (oom_above > 0) {
    trainer.add_policy(std::make_shared<frugal::OomRecovery>());
  }
  frugal::compat::WarningCapture capture;
  Trained out;
  for (int i = 0; i < 3; ++i) {
    out.micro_batches.push_back(trainer.step(kBatch).micro_batches);
  }
  out.warnings = capture.messages;
  out.state = frugal::testing::clone_all(net->parameters());
  for (const auto& b : frugal::testing::clone_all(net->buffers())) {
    out.state.push_back(b);
  }
  return out;
}

void expect_equal_state(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.state.size(), b.state.size());
  for (std::size_t i = 0; i < a.state.size(); ++i) {
    EXPECT_TRUE(torch::equal(a.state[i], b.state[i])) << "tensor " << i;
  }
}

TEST(BatchStatistics, WholeBatchRunsAModelWithBatchNormWholeBitForBit) {
  const auto whole = train(Net(), frugal::TrainerOptions());
  const auto kept = train(Net(), frugal::TrainerOptions().micro_batch(2).batch_statistics(
                                     frugal::BatchStatistics::WholeBatch));
  EXPECT_EQ(kept.micro_batches, (std::vector<std::int64_t>{1, 1, 1}));
  EXPECT_TRUE(kept.warnings.empty());
  expect_equal_state(kept, whole);  // running statistics and counters included
  const auto parts = train(Net(), frugal::TrainerOptions().micro_batches(4).batch_statistics(
                                      frugal::BatchStatistics::WholeBatch));
  EXPECT_EQ(parts.micro_batches, (std::vector<std::int64_t>{1, 1, 1}));
}

TEST(BatchStatistics, WholeBatchStillMicroBatchesAModelWithoutBatchNorm) {
  torch::manual_seed(51);
  torch::nn::Sequential plain(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  const auto r = train(plain, frugal::TrainerOptions().micro_batch(2).batch_statistics(
                                  frugal::BatchStatistics::WholeBatch));
  EXPECT_EQ(r.micro_batches, (std::vector<std::int64_t>{4, 4, 4}));
}

TEST(BatchStatistics, WholeBatchCutByAnOutOfMemoryErrorWarnsOnceNamingTheLayers) {
  const auto r = train(
      Net(),
      frugal::TrainerOptions().micro_batch(2).batch_statistics(frugal::BatchStatistics::WholeBatch),
      /*oom_above=*/4);
  EXPECT_EQ(r.micro_batches, (std::vector<std::int64_t>{2, 2, 2}));  // 8 samples in halves of 4
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("micro-batches of 4 samples"), std::string::npos) << r.warnings[0];
  EXPECT_NE(r.warnings[0].find("'features.1'"), std::string::npos) << r.warnings[0];
}

// The same choices in a frugal::Loop's accumulate: what three iterations of kBatch leave.
Trained loop_train(frugal::LoopOptions options) {
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Loop loop(std::move(options));
  auto& model = loop.prepare(net, sgd, "net");
  frugal::compat::WarningCapture capture;
  Trained out;
  for (int i = 0; i < 3; ++i) {
    loop.accumulate(kBatch, model, [&](const frugal::Batch& micro) {
      return F::cross_entropy(net->forward(micro.inputs), micro.targets);
    });
    loop.step(model);
    loop.end();
  }
  out.warnings = capture.messages;
  out.state = frugal::testing::clone_all(net->parameters());
  for (const auto& b : frugal::testing::clone_all(net->buffers())) {
    out.state.push_back(b);
  }
  return out;
}

TEST(BatchStatistics, TheLoopWarnsOnceNamingTheLayersOrStaysSilentWhenToldTo) {
  const auto warned = loop_train(frugal::LoopOptions().micro_batch(4));
  ASSERT_EQ(warned.warnings.size(), 1u);
  EXPECT_NE(warned.warnings[0].find("'features.1'"), std::string::npos) << warned.warnings[0];
  EXPECT_TRUE(loop_train(frugal::LoopOptions().micro_batch(4).batch_statistics(
                             frugal::BatchStatistics::Accept))
                  .warnings.empty());
  EXPECT_TRUE(loop_train(frugal::LoopOptions()).warnings.empty());
}

TEST(BatchStatistics, TheLoopRefusesWhenToldBeforeAnyForward) {
  Net net;
  torch::optim::SGD sgd(net->parameters(), 0.1);
  frugal::Loop loop(
      frugal::LoopOptions().micro_batch(4).batch_statistics(frugal::BatchStatistics::Refuse));
  auto& model = loop.prepare(net, sgd, "net");
  const auto buffers = frugal::testing::clone_all(net->buffers());
  frugal::testing::expect_error_contains(
      [&] {
        loop.accumulate(kBatch, model, [&](const frugal::Batch& micro) {
          return F::cross_entropy(net->forward(micro.inputs), micro.targets);
        });
      },
      "'features.1'");
  const auto after = net->buffers();
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    EXPECT_TRUE(torch::equal(buffers[i], after[i]));  // no forward ran
  }
  EXPECT_FALSE(loop.pending());
}

TEST(BatchStatistics, TheLoopKeepsWholeBatchesBitForBit) {
  const auto whole = loop_train(frugal::LoopOptions());
  const auto kept = loop_train(
      frugal::LoopOptions().micro_batch(2).batch_statistics(frugal::BatchStatistics::WholeBatch));
  EXPECT_TRUE(kept.warnings.empty());
  expect_equal_state(kept, whole);
}

}  // namespace batch_statistics
}  // namespace
