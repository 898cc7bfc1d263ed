// distributed::GradientAverage under frugal::Loop: two ranks, each backpropagating its half
// of every batch into two models, train as one process on the whole batch; a NaN loss on
// one rank skips that model's step on both.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "children.h"
#include "dist_launch.h"
#include "frugal/distributed/group.h"
#include "frugal/distributed/reducer.h"
#include "frugal/loop/loop.h"
#include "resume_setup.h"

namespace {
namespace gradient_average {  // helper names of its own in the unity build

using frugal::distributed::Group;

constexpr int kIterations = 6;
constexpr int kNanIteration = 3;
constexpr std::int64_t kBatch = 8;

// Two models in one loop: `a` fits a target, `b` fits `a`'s output. Rank `rank` of `world`
// takes rows [rank * kBatch / world, ...) of every batch; the NaN comes from the last rank.
std::vector<torch::Tensor> train(const std::shared_ptr<Group>& group) {
  torch::manual_seed(71);
  torch::nn::Sequential a(torch::nn::Linear(5, 8), torch::nn::Tanh(), torch::nn::Linear(8, 1));
  torch::nn::Linear b(5, 1);
  torch::optim::Adam a_opt(a->parameters(), 1e-2);
  torch::optim::SGD b_opt(b->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  frugal::Loop loop(
      frugal::LoopOptions().reducer(std::make_shared<frugal::distributed::GradientAverage>(group)));
  auto& ma = loop.prepare(a, a_opt, "a");
  auto& mb = loop.prepare(b, b_opt, "b");
  const std::int64_t share = kBatch / group->size();
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
    loop.end();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : a->parameters()) {
    out.push_back(p.detach().clone());
  }
  for (const auto& p : b->parameters()) {
    out.push_back(p.detach().clone());
  }
  out.push_back(torch::tensor({ma.skipped_steps(), mb.skipped_steps()}));
  return out;
}

const frugal::testing::RegisterChild register_loop_dp("loop-dp",
                                                      [](const std::vector<std::string>& args) {
                                                        return frugal::testing::train_rank_and_save(
                                                            args, train);
                                                      });

TEST(GradientAverage, TwoRanksOfALoopTrainAsOneProcessAndSkipTogether) {
  const auto ranks = frugal::testing::launch_and_load("loop-dp", 2);
  ASSERT_EQ(ranks.size(), 2u) << "a rank failed";
  torch::set_num_threads(1);
  const auto one = train(Group::single());
  EXPECT_EQ(one.back()[0].item<std::int64_t>(), 1);  // the NaN step skipped
  EXPECT_EQ(one.back()[1].item<std::int64_t>(), 0);
  for (int r = 0; r < 2; ++r) {
    const auto& ranked = ranks[static_cast<std::size_t>(r)];
    ASSERT_EQ(ranked.size(), one.size());
    EXPECT_TRUE(torch::equal(ranked.back(), one.back())) << "skipped steps, rank " << r;
    for (std::size_t i = 0; i + 1 < one.size(); ++i) {
      EXPECT_TRUE(torch::allclose(ranked[i], one[i], 1e-5, 1e-5))
          << "rank " << r << " parameter " << i << " differs by "
          << (ranked[i] - one[i]).abs().max().item<float>();
    }
  }
}

}  // namespace gradient_average
}  // namespace
