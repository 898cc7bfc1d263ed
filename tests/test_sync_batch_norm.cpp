// distributed::SyncBatchNorm: without a group it is torch::nn::BatchNorm bit for bit; two
// ranks holding unequal shares of a batch normalize, backpropagate and track running
// statistics as one process given the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "children.h"
#include "dist_launch.h"
#include "frugal/distributed/batch_norm.h"
#include "frugal/distributed/group.h"
#include "resume_setup.h"

namespace {
namespace sync_batch_norm {  // helper names of its own in the unity build

using frugal::distributed::Group;
using frugal::distributed::SyncBatchNorm;

// What one forward and backward leave: output, input gradient, parameter gradients, buffers.
std::vector<torch::Tensor> run_once(torch::nn::Module& bn, torch::nn::AnyModule call,
                                    const torch::Tensor& input, const torch::Tensor& upstream) {
  auto x = input.clone().requires_grad_(true);
  auto y = call.forward(x);
  std::vector<torch::Tensor> out{y.detach()};
  if (y.requires_grad()) {
    y.backward(upstream);
    out.push_back(x.grad());
    for (const auto& p : bn.parameters()) {
      out.push_back(p.defined() ? p.grad() : torch::Tensor());
    }
  }
  for (const auto& b : bn.buffers()) {
    out.push_back(b.clone());
  }
  return out;
}

template <typename Plain>
void expect_same_as(const torch::nn::BatchNormOptions& options, const torch::Tensor& input,
                    const std::shared_ptr<Group>& group, const std::string& what) {
  torch::manual_seed(3);
  const auto upstream = torch::randn(input.sizes());
  Plain plain(options);
  SyncBatchNorm sync(options, group);
  ASSERT_EQ(plain->named_parameters().keys(), sync->named_parameters().keys()) << what;
  ASSERT_EQ(plain->named_buffers().keys(), sync->named_buffers().keys()) << what;
  for (const bool training : {true, true, false}) {  // twice: the running statistics move
    plain->train(training);
    sync->train(training);
    for (auto* m : {static_cast<torch::nn::Module*>(plain.get()),
                    static_cast<torch::nn::Module*>(sync.get())}) {
      m->zero_grad();
    }
    const auto a = run_once(*plain, torch::nn::AnyModule(plain), input, upstream);
    const auto b = run_once(*sync, torch::nn::AnyModule(sync), input, upstream);
    ASSERT_EQ(a.size(), b.size()) << what;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].defined(), b[i].defined()) << what << ", item " << i;
      if (a[i].defined() && b[i].defined()) {
        EXPECT_TRUE(torch::equal(a[i], b[i]))
            << what << (training ? ", training" : ", eval") << ", item " << i;
      }
    }
  }
}

TEST(SyncBatchNorm, WithoutAGroupIsTorchBatchNormBitForBit) {
  using Options = torch::nn::BatchNormOptions;
  const auto images = torch::randn({6, 3, 5, 4}) * 2 + 1;
  const auto rows = torch::randn({7, 3}) - 3;
  const auto sequences = torch::randn({4, 3, 9});
  for (const auto& group : {std::shared_ptr<Group>(), Group::single()}) {
    const std::string who = group ? "a group of one" : "no group";
    expect_same_as<torch::nn::BatchNorm2d>(Options(3), images, group, who + ", 2d");
    expect_same_as<torch::nn::BatchNorm1d>(Options(3), rows, group, who + ", 1d rows");
    expect_same_as<torch::nn::BatchNorm1d>(Options(3).momentum(c10::nullopt), sequences, group,
                                           who + ", 1d sequences, cumulative average");
    expect_same_as<torch::nn::BatchNorm2d>(Options(3).affine(false), images, group,
                                           who + ", 2d without affine");
    expect_same_as<torch::nn::BatchNorm3d>(Options(3).track_running_stats(false),
                                           images.unsqueeze(2), group,
                                           who + ", 3d without running statistics");
  }
}

TEST(SyncBatchNorm, BadInputIsNamed) {
  SyncBatchNorm bn(4);
  try {
    bn(torch::randn({2, 3, 5}));
    FAIL() << "three channels into four features accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("4 features got an input of 3 channels"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(bn(torch::randn({4})), std::exception);
}

TEST(SyncBatchNorm, SynchronizeReachesEveryLayerOfATree) {
  auto inner = std::make_shared<torch::nn::Module>();
  inner->register_module("bn", SyncBatchNorm(2));
  torch::nn::Module root;
  root.register_module("inner", inner);
  auto bn = root.register_module("bn", SyncBatchNorm(2));
  root.register_module("plain", torch::nn::BatchNorm1d(2));
  const auto group = Group::single();
  EXPECT_EQ(frugal::distributed::synchronize_batch_norm(root, group), 2u);
  EXPECT_EQ(bn->group(), group);
  SyncBatchNorm alone(3);
  EXPECT_EQ(frugal::distributed::synchronize_batch_norm(*alone, group), 1u);
  std::ostringstream printed;
  printed << *alone;
  EXPECT_NE(printed.str().find("SyncBatchNorm(3"), std::string::npos) << printed.str();
}

constexpr std::int64_t kBatch = 8;
constexpr int kSteps = 3;

// A convolution into SyncBatchNorm (2d), a linear layer into SyncBatchNorm (1d, rows, no
// affine parameters), a head; SGD on the loss summed over this rank's rows and divided by the whole
// batch, the parameter gradients summed over the ranks: the gradient of the whole batch's mean
// loss. Rank 0 holds the first 3 rows of 8, rank 1 the other 5. Returns the first step's outputs
// and input gradients for this rank's rows, then the parameters and buffers at the end.
std::vector<torch::Tensor> train(const std::shared_ptr<Group>& group) {
  torch::manual_seed(29);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)),
                            SyncBatchNorm(4), torch::nn::ReLU(), torch::nn::Flatten(),
                            torch::nn::Linear(4 * 5 * 5, 6),
                            SyncBatchNorm(torch::nn::BatchNormOptions(6).affine(false)),
                            torch::nn::Tanh(), torch::nn::Linear(6, 1));
  frugal::distributed::synchronize_batch_norm(*net, group);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.5));
  const std::int64_t first = group->rank() == 0 ? 0 : 3;
  const std::int64_t rows = group->size() == 1 ? kBatch : (group->rank() == 0 ? 3 : 5);
  std::vector<torch::Tensor> out;
  for (int step = 0; step < kSteps; ++step) {
    const auto batch = torch::randn({kBatch, 2, 5, 5}) * 3 + 0.5;
    const auto target = torch::randn({kBatch, 1});
    auto x = batch.narrow(0, first, rows).clone().requires_grad_(true);
    opt.zero_grad();
    auto y = net->forward(x);
    auto loss = (y - target.narrow(0, first, rows)).pow(2).sum() / kBatch;
    loss.backward();
    for (auto& p : net->parameters()) {
      auto g = p.grad();
      group->all_reduce(g).wait();
    }
    opt.step();
    if (step == 0) {
      out.push_back(y.detach());
      out.push_back(x.grad());
    }
  }
  for (const auto& p : net->parameters()) {
    out.push_back(p.detach().clone());
  }
  for (const auto& b : net->buffers()) {
    out.push_back(b.clone());
  }
  return out;
}

const auto register_sync_bn = frugal::testing::register_rank_training("sync-bn", train);

TEST(SyncBatchNorm, TwoRanksWithUnequalSharesTrainAsOneProcess) {
  const auto [ranks, one] = frugal::testing::ranks_and_one_process("sync-bn", 2, train);
  ASSERT_EQ(ranks.size(), 2u) << "a rank failed";
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranks[static_cast<std::size_t>(r)].size(), one.size()) << "rank " << r;
  }
  auto close = [](const torch::Tensor& a, const torch::Tensor& b, const std::string& what) {
    ASSERT_EQ(a.sizes(), b.sizes()) << what;
    EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6))
        << what << " differs by " << (a - b).abs().max().item<double>();
  };
  // The first step: each rank's rows of the output and of the input gradient.
  for (std::size_t i = 0; i < 2; ++i) {
    close(torch::cat({ranks[0][i], ranks[1][i]}), one[i],
          i == 0 ? "the first output" : "the first input gradient");
  }
  for (std::size_t i = 2; i < one.size(); ++i) {  // parameters, running statistics, counters
    for (int r = 0; r < 2; ++r) {
      close(ranks[static_cast<std::size_t>(r)][i].to(torch::kDouble), one[i].to(torch::kDouble),
            "rank " + std::to_string(r) + " tensor " + std::to_string(i));
    }
  }
  // The first layer's running mean (the sixth tensor from the end) moved away from its zeros:
  // the comparison of running statistics meant something.
  const auto& running_mean = one[one.size() - 6];
  EXPECT_GT(running_mean.abs().max().item<double>(), 0.01);
}

// sync-bn-mismatch ERR: rank R builds SyncBatchNorm(4 + 4 R) and runs a training forward on
// inputs of its own width; what it threw goes to ERR-<rank>.txt.
int mismatched_rank(const std::vector<std::string>& args) {
  torch::set_num_threads(1);
  const auto env = frugal::distributed::LaunchEnv::from_environment();
  auto group =
      Group::join(env, frugal::distributed::GroupOptions().timeout(std::chrono::seconds(60)));
  const std::int64_t channels = 4 + 4 * env.rank;
  SyncBatchNorm bn(torch::nn::BatchNormOptions(channels), group);
  try {
    bn->forward(torch::randn({3, channels}));
  } catch (const std::exception& e) {
    std::ofstream(args.at(0) + "-" + std::to_string(env.rank) + ".txt") << frugal::error_message(e);
    return 1;
  }
  return 0;
}
const frugal::testing::RegisterChild register_mismatch("sync-bn-mismatch", mismatched_rank);

TEST(SyncBatchNorm, LayersOfOtherSizesOnTheRanksAreRefusedByNameOnEveryRank) {
  const auto dir = frugal::testing::fresh_temp_dir("frugal-sync-bn-mismatch");
  const auto err = (dir / "err").string();
  ASSERT_EQ(frugal::testing::launch("sync-bn-mismatch", 2, {err}), (std::vector<int>{1, 1}));
  for (int r = 0; r < 2; ++r) {
    std::ifstream in(err + "-" + std::to_string(r) + ".txt");
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    EXPECT_NE(text.find("SyncBatchNorm of " + std::to_string(4 + 4 * r) + " features on rank " +
                        std::to_string(r) + " is synchronized with layers of other sizes"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("(rank 0: 4, rank 1: 8)"), std::string::npos) << text;
  }
}

}  // namespace sync_batch_norm
}  // namespace
