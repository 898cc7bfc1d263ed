// frugal::Loop over distributed::Reducer, the one bucketed reducer DataParallel uses: ranks
// each backpropagating an equal share of every batch train as one process on the whole
// batch, with plain optimizers and ZeRO stages 2 and 3, accumulation and NoSync; a NaN loss
// on one rank skips that model's step on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "children.h"
#include "dist_launch.h"
#include "frugal/distributed/group.h"
#include "frugal/distributed/reducer.h"
#include "frugal/distributed/zero.h"
#include "frugal/loop/loop.h"
#include "frugal/policy/grad_scaler.h"
#include "helpers.h"
#include "resume_setup.h"

namespace {
namespace loop_data_parallel {  // helper names of its own in the unity build

using frugal::distributed::Group;
using frugal::distributed::Reducer;

constexpr int kIterations = 6;
constexpr int kNanIteration = 3;
constexpr std::int64_t kBatch = 12;  // equal shares on 2 and 3 ranks
constexpr std::int64_t kSteps = 10;

std::shared_ptr<frugal::GradientReducer> reducer_of(const std::shared_ptr<Group>& group) {
  return group ? std::make_shared<Reducer>(
                     group,
                     frugal::distributed::ReducerOptions().bucket_bytes(256))  // several buckets
               : nullptr;
}

// Two models in one loop: `a` fits a target, `b` fits `a`'s output. Rank `rank` of `world`
// takes its share of every batch; the NaN comes from the last rank.
std::vector<torch::Tensor> train_two(const std::shared_ptr<Group>& group) {
  torch::manual_seed(71);
  torch::nn::Sequential a(torch::nn::Linear(5, 8), torch::nn::Tanh(), torch::nn::Linear(8, 1));
  torch::nn::Linear b(5, 1);
  torch::optim::Adam a_opt(a->parameters(), 1e-2);
  torch::optim::SGD b_opt(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  frugal::Loop loop(frugal::LoopOptions().reducer(std::make_shared<Reducer>(group)));
  auto& ma = loop.prepare(a, a_opt, "a");
  auto& mb = loop.prepare(b, b_opt, "b");
  const std::int64_t share = kBatch / group->size();
  std::vector<double> reported;  // each iteration's loss of `a` and of `b`, as Loop::end says
  for (int i = 0; i < kIterations; ++i) {
    const auto x = torch::randn({kBatch, 5}).narrow(0, group->rank() * share, share);
    auto out = a->forward(x);
    auto a_loss = (out - x.sum(1, true)).pow(2).mean();
    if (i == kNanIteration && group->rank() == group->size() - 1) {
      a_loss = a_loss * std::nan("");
    }
    loop.backward(a_loss, ma);
    loop.step(ma);
    loop.backward((b->forward(x) - out.detach()).pow(2).mean(), mb);
    loop.step(mb);
    const auto report = loop.end();
    reported.push_back(report.models[0].loss);
    reported.push_back(report.models[1].loss);
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : a->parameters()) {
    out.push_back(p.detach().clone());
  }
  for (const auto& p : b->parameters()) {
    out.push_back(p.detach().clone());
  }
  out.push_back(torch::tensor(reported, torch::kDouble));
  out.push_back(torch::tensor({ma.skipped_steps(), mb.skipped_steps()}));
  return out;
}

const auto register_loop_dp = frugal::testing::register_rank_training("loop-dp", train_two);

TEST(LoopDataParallel, TwoRanksOfALoopTrainAsOneProcessAndSkipTogether) {
  const auto [ranks, one] = frugal::testing::ranks_and_one_process("loop-dp", 2, train_two);
  ASSERT_EQ(ranks.size(), 2u) << "a rank failed";
  EXPECT_EQ(one.back()[0].item<std::int64_t>(), 1);  // the NaN step skipped
  EXPECT_EQ(one.back()[1].item<std::int64_t>(), 0);
  for (int r = 0; r < 2; ++r) {
    const auto& ranked = ranks[static_cast<std::size_t>(r)];
    ASSERT_EQ(ranked.size(), one.size());
    EXPECT_TRUE(torch::equal(ranked.back(), one.back())) << "skipped steps, rank " << r;
    // The parameters, then the reported losses: each rank reports the whole batch's loss
    // (the ranks' mean), NaN on every rank where one rank's was.
    for (std::size_t i = 0; i + 1 < one.size(); ++i) {
      EXPECT_TRUE(torch::allclose(ranked[i], one[i], 1e-5, 1e-5, /*equal_nan=*/true))
          << "rank " << r << " parameter " << i << " differs by "
          << (ranked[i] - one[i]).abs().max().item<float>();
    }
  }
}

int held_gradients(const torch::nn::Module& model) {
  int n = 0;
  for (const auto& p : model.parameters()) {
    n += p.grad().defined() ? 1 : 0;
  }
  return n;
}

// adam: one backward a step; micro: accumulate in micro-batches of 2; twice: two reducing
// backwards a step (the first completed before the second); nosync: the first of two under
// Loop::NoSync; zero2 / zero3: micro / adam with a ZeroOptimizer of that stage.
const std::vector<std::string> kModes{"adam", "micro", "twice", "nosync", "zero2", "zero3"};

// Trains `mode` for kSteps on this process's share of each batch (the whole batch without a
// group); returns the parameters and, last, the whole batch's loss at each step.
std::vector<torch::Tensor> train_mode(const std::string& mode,
                                      const std::shared_ptr<Group>& group) {
  torch::manual_seed(5);
  const auto x = torch::randn({kSteps, kBatch, 6});
  const auto y = torch::randn({kSteps, kBatch, 2});
  torch::manual_seed(group ? 40 + group->rank() : 40);  // ranks start apart: rank 0's win
  torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 2));
  const int stage = mode == "zero2" ? 2 : mode == "zero3" ? 3 : 0;
  auto make = [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
  };
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (stage > 0) {
    optimizer = std::make_unique<frugal::distributed::ZeroOptimizer>(
        model->parameters(), group, make,
        frugal::distributed::ZeroOptimizerOptions().stage(stage).gather_bytes(64));
  } else if (mode == "twice" || mode == "nosync") {
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                    torch::optim::SGDOptions(0.05).momentum(0.9));
  } else {
    optimizer = make(model->parameters());
  }
  auto options = frugal::LoopOptions().reducer(reducer_of(group));
  if (mode == "micro" || mode == "zero2") {
    options.micro_batch(2);
  }
  frugal::Loop loop(options);
  auto& m = loop.prepare(model, *optimizer, "model");
  const int world = group ? group->size() : 1;
  const int rank = group ? group->rank() : 0;
  const std::int64_t share = kBatch / world;
  auto mse = [](const torch::Tensor& out, const torch::Tensor& target) {
    return (out - target).pow(2).mean();
  };
  std::vector<double> losses;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const auto xs = x[s].narrow(0, rank * share, share);
    const auto ys = y[s].narrow(0, rank * share, share);
    double loss = 0;
    if (mode == "micro" || mode == "zero2") {
      loss = loop.accumulate({xs, ys}, m, [&](const frugal::Batch& b) {
        return mse(model->forward(b.inputs), b.targets);
      });
    } else if (mode == "twice" || mode == "nosync") {
      const auto first = mse(model->forward(xs), ys);
      const auto second = 0.5 * model->forward(xs * 2).abs().mean();
      loss = first.item<double>() + second.item<double>();
      {
        c10::optional<frugal::Loop::NoSync> quiet;
        if (mode == "nosync") {
          quiet.emplace(loop, m);
        }
        loop.backward(first, m);
      }
      // Under NoSync the gradients stay on the parameters; a reducing backward hands each to
      // its bucket as autograd finishes it, so none is left on them when it returns.
      TORCH_CHECK(world == 1 || held_gradients(*model) == (mode == "nosync" ? 6 : 0),
                  "after the first backward of ", mode, ": ", held_gradients(*model));
      loop.backward(second, m);
      TORCH_CHECK(world == 1 || held_gradients(*model) == 0, "after the reducing backward of ",
                  mode, ": ", held_gradients(*model), " gradients not in a bucket");
    } else {
      const auto l = mse(model->forward(xs), ys);
      loss = l.item<double>();
      loop.backward(l, m);
    }
    loop.step(m);
    loop.end();
    losses.push_back(group ? group->sum(loss) / world : loss);  // equal shares
  }
  std::vector<torch::Tensor> out;
  {
    std::unique_ptr<frugal::optim::GatheredParameters> whole;  // stage 3: the whole weights
    if (auto* sharded = dynamic_cast<frugal::optim::ShardedOptimizer*>(optimizer.get())) {
      whole = std::make_unique<frugal::optim::GatheredParameters>(*sharded);
    }
    for (const auto& p : model->parameters()) {
      out.push_back(p.detach().clone());
    }
  }
  out.push_back(torch::tensor(losses, torch::kDouble));
  return out;
}

std::vector<torch::Tensor> train_modes(const std::shared_ptr<Group>& group) {
  std::vector<torch::Tensor> out;
  for (const auto& mode : kModes) {
    const auto one = train_mode(mode, group);
    out.insert(out.end(), one.begin(), one.end());
  }
  return out;
}

const auto register_loop_modes =
    frugal::testing::register_rank_training("loop-dp-modes", train_modes);

void expect_loop_ranks_match_one_process(int world) {
  const auto ranks = frugal::testing::launch_and_load("loop-dp-modes", world);
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(world)) << "a rank failed";
  torch::set_num_threads(1);
  std::size_t at = 0;
  for (const auto& mode : kModes) {
    SCOPED_TRACE(mode);
    // One process, no reducer, the whole batch; ZeRO's against the optimizer it wraps.
    const auto one = train_mode(mode == "zero2"   ? "micro"
                                : mode == "zero3" ? "adam"
                                                  : mode,
                                nullptr);
    for (int r = 0; r < world; ++r) {
      const auto& ranked = ranks[static_cast<std::size_t>(r)];
      ASSERT_GE(ranked.size(), at + one.size());
      for (std::size_t i = 0; i < one.size(); ++i) {
        const auto& got = ranked[at + i];
        EXPECT_TRUE(torch::allclose(got, one[i], 1e-5, 1e-5))
            << "rank " << r << (i + 1 == one.size() ? " losses" : " parameter ") << i
            << " differ by " << (got - one[i]).abs().max().item<double>();
      }
    }
    at += one.size();
  }
}

TEST(LoopDataParallel, TwoRanksTrainAsOneProcessWithZeroAndAccumulation) {
  expect_loop_ranks_match_one_process(2);
}

TEST(LoopDataParallel, ThreeRanksTrainAsOneProcessWithZeroAndAccumulation) {
  expect_loop_ranks_match_one_process(3);
}

TEST(LoopDataParallel, AShardedGradientIsReducedOncePerStepAndNeverReadByAScaler) {
  torch::manual_seed(3);
  torch::nn::Linear model(4, 2);
  auto make = [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::SGD>(params, 0.1);
  };
  frugal::distributed::ZeroOptimizer zero(model->parameters(), Group::single(), make,
                                          frugal::distributed::ZeroOptimizerOptions().stage(2));
  auto reducer = std::make_shared<Reducer>(Group::single());
  {
    frugal::Loop loop(frugal::LoopOptions().reducer(reducer).scaler(
        std::make_shared<frugal::GradScaler>(frugal::GradScalerOptions().enabled(true))));
    frugal::testing::expect_error_contains([&] { loop.prepare(model, zero, "model"); },
                                           "the loop's loss scaler and the optimizer of 'model' "
                                           "cannot work together");
    EXPECT_TRUE(loop.models().empty());  // a refused model leaves the loop as it was
  }
  frugal::Loop loop(frugal::LoopOptions().reducer(reducer));
  auto& m = loop.prepare(model, zero, "model");
  auto loss = [&] { return model->forward(torch::ones({3, 4})).sum(); };
  loop.backward(loss(), m);
  const auto weight = model->weight.detach().clone();
  frugal::testing::expect_error_contains([&] { loop.backward(loss(), m); },
                                         "keeps only its share of them; backpropagate the "
                                         "earlier losses under Loop::NoSync");
  EXPECT_TRUE(torch::equal(model->weight, weight));
  EXPECT_TRUE(loop.step(m));
  EXPECT_FALSE(torch::equal(model->weight, weight));
}

}  // namespace loop_data_parallel
}  // namespace
