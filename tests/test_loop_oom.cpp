// frugal::Loop::accumulate with oom_recovery: an out-of-memory error halves the micro-batch
// and runs the batch again, the effective batch and its gradient kept; at micro-batch 1 it
// gives up with the gradients from before the call as they were.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <stdexcept>
#include <string>

#include "frugal/loop/loop.h"
#include "helpers.h"

namespace {
namespace loop_oom {  // helper names of its own in the unity build

namespace F = torch::nn::functional;

// A linear model trained by SGD in a Loop that cuts micro-batches of `micro`, with or
// without oom_recovery, and two batches of random samples, all from `seed`.
struct OneLinear {
  OneLinear(std::uint64_t seed, std::int64_t micro, bool recovery, std::int64_t first_size,
            std::int64_t second_size)
      : seeded((torch::manual_seed(seed), true)),
        sgd(model->parameters(), 0.1),
        loop(frugal::LoopOptions().micro_batch(micro).oom_recovery(recovery)),
        m(loop.prepare(model, sgd, "model")),
        first{torch::randn({first_size, 5}), torch::randint(3, {first_size})},
        second{torch::randn({second_size, 5}), torch::randint(3, {second_size})} {}
  bool seeded;  // the seed is set before the model and the batches are made
  torch::nn::Linear model{5, 3};
  torch::optim::SGD sgd;
  frugal::Loop loop;
  frugal::LoopModel& m;
  frugal::Batch first, second;
};

TEST(Loop, AnOutOfMemoryErrorHalvesTheMicroBatchAndKeepsTheGradient) {
  auto run = [](bool cramped) {
    OneLinear s(42, /*micro=*/8, /*recovery=*/true, 6, 12);
    auto loss = [&](const frugal::Batch& b) {
      // Cramped: more than 3 samples at once do not fit.
      TORCH_CHECK_WITH(OutOfMemoryError, !cramped || b.size() <= 3, "simulated: ", b.size(),
                       " samples do not fit");
      return F::cross_entropy(s.model->forward(b.inputs), b.targets);
    };
    const double a = s.loop.accumulate(s.first, s.m, loss);   // cramped: 6, then 4 + 2, then 2s
    const double b = s.loop.accumulate(s.second, s.m, loss);  // at 2 from the start
    auto grads = frugal::testing::grads_of(*s.model);
    const auto report = (s.loop.step(s.m), s.loop.end());
    return std::make_tuple(a + b, grads, s.loop.micro_batch(), report.models[0].oom_retries);
  };
  const auto [roomy_loss, roomy_grads, roomy_micro, roomy_retries] = run(false);
  const auto [loss, grads, micro, retries] = run(true);
  EXPECT_EQ(roomy_micro, 8);
  EXPECT_EQ(roomy_retries, 0);
  EXPECT_EQ(micro, 2);
  EXPECT_EQ(retries, 2);  // 8 -> 4 -> 2
  EXPECT_NEAR(loss, roomy_loss, 1e-6);
  frugal::testing::expect_all_close(grads, roomy_grads);  // the first batch's kept, not doubled
}

// A loss that fails (with `oom`, or another error) from the `from`-th call on (passed by
// std::ref: the calls count across accumulate calls).
struct Failing {
  torch::nn::Linear& model;
  int from;
  bool oom;
  int calls = 0;
  torch::Tensor operator()(const frugal::Batch& b) {
    if (++calls >= from) {
      if (oom) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "simulated: nothing fits");
      }
      throw std::runtime_error("the data went bad");
    }
    return F::cross_entropy(model->forward(b.inputs), b.targets);
  }
};

TEST(Loop, OutOfMemoryAtMicroBatchOneGivesUpWithTheEarlierGradientsAsTheyWere) {
  OneLinear s(7, /*micro=*/4, /*recovery=*/true, 8, 8);
  Failing loss{s.model, /*from=*/3, /*oom=*/true};
  s.loop.accumulate(s.first, s.m, std::ref(loss));  // two micro-batches of 4
  const auto after_first = frugal::testing::clone_all(frugal::testing::grads_of(*s.model));
  frugal::testing::expect_error_contains([&] { s.loop.accumulate(s.second, s.m, std::ref(loss)); },
                                         "out of memory at micro-batch 1 (the floor is 1)");
  EXPECT_EQ(s.loop.micro_batch(), 1);  // 4 -> 2 -> 1, then nothing smaller to try
  frugal::testing::expect_all_close(frugal::testing::grads_of(*s.model), after_first);
  const auto report = (s.loop.step(s.m), s.loop.end());
  EXPECT_EQ(report.models[0].backwards, 1);  // the first batch's, counted once
  EXPECT_EQ(report.models[0].oom_retries, 2);
}

TEST(Loop, AnotherErrorUnderOomRecoveryLeavesTheGradientsAsWithoutIt) {
  auto run = [](bool recovery) {
    OneLinear s(7, /*micro=*/4, recovery, 8, 8);
    Failing loss{s.model, /*from=*/4, /*oom=*/false};
    s.loop.accumulate(s.first, s.m, std::ref(loss));
    EXPECT_THROW(s.loop.accumulate(s.second, s.m, std::ref(loss)), std::runtime_error);
    return frugal::testing::clone_all(frugal::testing::grads_of(*s.model));
  };
  // The first batch's gradient plus the second batch's first micro-batch, as a plain loop
  // leaves them: the error is the caller's to handle.
  frugal::testing::expect_all_close(run(true), run(false));
}

}  // namespace loop_oom
}  // namespace
