#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/checkpoint.h"
#include "frugal/nn/checkpoint.h"
#include "frugal/policy/autocast.h"
#include "frugal/policy/checkpoint_policy.h"
#include "helpers.h"
#include "residual_mlp.h"

namespace frugal::testing::checkpoint_result {
// A block result of the program's own type: a tensor and the count of runs that made it.
struct Scored {
  torch::Tensor y;
  int run = 0;
};
}  // namespace frugal::testing::checkpoint_result

template <>
struct frugal::CheckpointResult<frugal::testing::checkpoint_result::Scored> {
  using Scored = frugal::testing::checkpoint_result::Scored;
  static std::vector<torch::Tensor> tensors(const Scored& r) { return {r.y}; }
  static Scored rebuild(const Scored& r, const std::vector<torch::Tensor>& t) {
    return {t.at(0), r.run};
  }
};

namespace {

using frugal::testing::clone_all;
using frugal::testing::expect_all_close;
using frugal::testing::grads_of;

torch::nn::Sequential reference_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(100, 50), torch::nn::ReLU(),
                               torch::nn::Linear(50, 20), torch::nn::ReLU(),
                               torch::nn::Linear(20, 5), torch::nn::ReLU());
}

struct Result {
  torch::Tensor output, input_grad;
  std::vector<torch::Tensor> param_grads;
};

template <typename Forward>
Result run(torch::nn::Sequential net, Forward forward, bool input_requires_grad = true) {
  torch::manual_seed(6);
  auto x = torch::randn({1, 100}).requires_grad_(input_requires_grad);
  Result r;
  r.output = forward(net, x);
  r.output.sum().backward();
  r.output = r.output.detach();
  r.input_grad = input_requires_grad ? x.grad().clone() : torch::Tensor();
  r.param_grads = grads_of(*net);
  return r;
}

void expect_same(const Result& a, const Result& b) {
  EXPECT_TRUE(torch::equal(a.output, b.output));
  if (a.input_grad.defined() || b.input_grad.defined()) {
    EXPECT_TRUE(torch::allclose(a.input_grad, b.input_grad));
  }
  expect_all_close(a.param_grads, b.param_grads);
}

torch::Tensor plain(torch::nn::Sequential& net, const torch::Tensor& x) { return net->forward(x); }

TEST(Checkpoint, SequentialWithTwoSegmentsEqualsThePlainRun) {
  const auto expected = run(reference_net(), plain);
  expect_same(run(reference_net(),
                  [](torch::nn::Sequential& net, const torch::Tensor& x) {
                    return frugal::checkpoint_sequential(net, 2, x);
                  }),
              expected);
}

TEST(Checkpoint, EveryBlockWrappedEqualsThePlainRun) {
  const auto expected = run(reference_net(), plain);
  auto net = reference_net();
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().every(1));
  EXPECT_EQ(policy.apply(*net).size(), 6u);
  expect_same(run(net, plain), expected);
}

TEST(Checkpoint, InputNotRequiringGradStillTrainsTheParameters) {
  const auto expected = run(reference_net(), plain, /*input_requires_grad=*/false);
  auto net = reference_net();
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().every(1));
  policy.apply(*net);
  const auto got = run(net, plain, false);
  for (const auto& g : got.param_grads) {
    ASSERT_TRUE(g.defined());
  }
  expect_same(got, expected);
}

// A module that doubles its input and counts its calls.
class CountingImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return x * 2;
  }
  int calls = 0;
};
TORCH_MODULE(Counting);

TEST(Checkpoint, SegmentsRecomputeOnlyTheCheckpointedChunks) {
  torch::nn::Sequential seq;
  std::vector<Counting> modules;
  for (int i = 0; i < 10; ++i) {
    modules.emplace_back();
    seq->push_back(modules.back());
  }
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = frugal::checkpoint_sequential(seq, 2, x);
  for (const auto& m : modules) {
    EXPECT_EQ(m->calls, 1);
  }
  y.sum().backward();
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(modules[i]->calls, i < 5 ? 2 : 1) << "module " << i;
  }
  EXPECT_TRUE(torch::allclose(x.grad(), torch::full({3}, 1024.0)));
}

torch::Tensor dropout_input_grad(bool checkpointed, bool preserve) {
  torch::manual_seed(42);
  auto x = torch::randn({20000}, torch::requires_grad());
  auto inner = [](const torch::Tensor& t) {
    return torch::dropout(torch::dropout(t, 0.5, true) * 3, 0.3, true);
  };
  auto h = torch::dropout(x, 0.5, true);  // before the checkpoint
  auto y = checkpointed ? frugal::checkpoint(
                              inner, frugal::CheckpointOptions().preserve_rng_state(preserve), h)
                        : inner(h);
  y.sum().backward();
  return x.grad().clone();
}

TEST(Checkpoint, DropoutMasksMatchThePlainRun) {
  for (int rep = 0; rep < 5; ++rep) {
    EXPECT_TRUE(torch::equal(dropout_input_grad(true, true), dropout_input_grad(false, true)))
        << "repetition " << rep;
  }
  EXPECT_NO_THROW(dropout_input_grad(true, false));
}

TEST(Checkpoint, CallersRngStreamIsAsIfNoRecomputeHappened) {
  auto draw_after = [](bool checkpointed) {
    torch::manual_seed(3);
    auto x = torch::randn({100}, torch::requires_grad());
    auto f = [](const torch::Tensor& t) { return torch::dropout(t, 0.5, true); };
    auto y = checkpointed ? frugal::checkpoint(f, x) : f(x);
    y.sum().backward();
    return torch::rand({5});
  };
  EXPECT_TRUE(torch::equal(draw_after(true), draw_after(false)));
}

TEST(Checkpoint, NonTensorArgumentsOutputsAndSeveralOutputs) {
  auto f = [](const torch::Tensor& a, double scale, const std::string& tag,
              const torch::Tensor& b) {
    return std::make_tuple(a * scale + b, tag + "!", (a * b).sin(), 7);
  };
  auto a = torch::randn({4}, torch::requires_grad());
  auto b = torch::randn({4}, torch::requires_grad());
  auto [y1, text, y2, seven] = frugal::checkpoint(f, a, 2.5, std::string("hi"), b);
  EXPECT_EQ(text, "hi!");
  EXPECT_EQ(seven, 7);
  (y1.sum() + y2.sum()).backward();
  const auto ga = a.grad().clone(), gb = b.grad().clone();
  a.mutable_grad().reset();
  b.mutable_grad().reset();
  auto [p1, ptext, p2, pseven] = f(a, 2.5, "hi", b);
  (p1.sum() + p2.sum()).backward();
  EXPECT_TRUE(torch::allclose(ga, a.grad()));
  EXPECT_TRUE(torch::allclose(gb, b.grad()));
}

TEST(Checkpoint, AResultTypeOfTheProgramsOwnThroughCheckpointResult) {
  using frugal::testing::checkpoint_result::Scored;
  int runs = 0;
  auto f = [&runs](const torch::Tensor& x) { return Scored{x.sin() * x, ++runs}; };
  auto x = torch::randn({6}, torch::requires_grad());
  const Scored got = frugal::checkpoint(f, x);
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(got.run, 1);
  got.y.sum().backward();
  EXPECT_EQ(runs, 2);  // recomputed in backward
  const auto grad = x.grad().clone();
  x.mutable_grad().reset();
  const Scored plain = f(x);
  plain.y.sum().backward();
  EXPECT_TRUE(torch::allclose(got.y.detach(), plain.y.detach()));
  EXPECT_TRUE(torch::allclose(grad, x.grad()));
}

TEST(Checkpoint, UndefinedTensorArgument) {
  auto f = [](const torch::Tensor& x, const torch::Tensor& maybe_bias) {
    return maybe_bias.defined() ? x * 3 + maybe_bias : x * 3;
  };
  auto x = torch::randn({5}, torch::requires_grad());
  auto y = frugal::checkpoint(f, x, torch::Tensor());
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), torch::full({5}, 3.0)));
}

TEST(Checkpoint, NestedCheckpointsEqualThePlainRun) {
  auto x = torch::randn({10}, torch::requires_grad());
  auto nested = frugal::checkpoint(
      [](const torch::Tensor& t) {
        auto inner = frugal::checkpoint(
            [](const torch::Tensor& u) {
              return frugal::checkpoint([](const torch::Tensor& v) { return v.sin(); }, u).exp();
            },
            t);
        return inner.sin();
      },
      x);
  nested.sum().backward();
  const auto got = x.grad().clone();
  x.mutable_grad().reset();
  x.sin().exp().sin().sum().backward();
  EXPECT_TRUE(torch::allclose(nested.detach(), x.sin().exp().sin().detach()));
  EXPECT_TRUE(torch::allclose(got, x.grad()));
}

TEST(Checkpoint, Bf16AutocastRecomputeMatchesTheAutocastRun) {
  auto run_bf16 = [](bool checkpointed) {
    auto net = reference_net();
    auto x = torch::randn({4, 100}, torch::requires_grad());
    torch::Tensor y;
    {
      frugal::AutocastGuard bf16(torch::kCPU, torch::kBFloat16);
      y = checkpointed ? frugal::checkpoint_sequential(net, 3, x) : net->forward(x);
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    y.to(torch::kFloat).sum().backward();
    auto grads = grads_of(*net);
    grads.push_back(x.grad().clone());
    return grads;
  };
  const auto plain_grads = run_bf16(false);
  const auto ckpt_grads = run_bf16(true);
  for (const auto& g : ckpt_grads) {
    EXPECT_EQ(g.scalar_type(), torch::kFloat);
  }
  expect_all_close(ckpt_grads, plain_grads, 0, 0);
}

TEST(Checkpoint, SecondBackwardThroughAFreedCheckpointSaysSo) {
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = frugal::checkpoint([](const torch::Tensor& t) { return t.exp(); }, x).sum();
  y.backward({}, /*retain_graph=*/false);
  try {
    y.backward();
    FAIL() << "a second backward went through";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, DoubleBackwardIsRefusedWithAReason) {
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = frugal::checkpoint([](const torch::Tensor& t) { return t.pow(3); }, x).sum();
  try {
    torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true);
    FAIL() << "double backward went through";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("double backward"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, BlockThatDetachesItsOutputIsNamed) {
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = frugal::checkpoint([](const torch::Tensor& t) { return (t * 2).detach(); }, x);
  ASSERT_TRUE(y.requires_grad());  // the function's output is in the graph
  try {
    y.sum().backward();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("none of the checkpointed block's outputs"),
              std::string::npos)
        << e.what();
  }
}

// Two Linear layers with a ReLU between, checkpointed with their parameters named; while
// the recompute's backward reaches the hidden activation, `seen` records whether the
// second layer's weight already has its gradient.
struct TwoLayers {
  torch::nn::Linear first{8, 16}, second{16, 4};
  bool seen = false;

  TwoLayers() {
    torch::manual_seed(11);
    first = torch::nn::Linear(8, 16);
    second = torch::nn::Linear(16, 4);
  }
  std::vector<torch::Tensor> params() const {
    auto p = first->parameters();
    const auto q = second->parameters();
    p.insert(p.end(), q.begin(), q.end());
    return p;
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = torch::relu(first(x));
    if (hidden.requires_grad()) {
      hidden.register_hook(
          [this](const torch::Tensor&) { seen = second->weight.grad().defined(); });
    }
    return second(hidden);
  }
  torch::Tensor checkpointed(const torch::Tensor& x) {
    return frugal::checkpoint([this](const torch::Tensor& t) { return forward(t); },
                              frugal::CheckpointOptions().params(params()), x);
  }
};

TEST(Checkpoint, EachParameterAccumulatesAsTheRecomputesBackwardReachesIt) {
  const auto x = torch::randn({5, 8});
  TwoLayers plain_run;
  plain_run.forward(x).square().sum().backward();
  ASSERT_TRUE(plain_run.seen);  // the reference: an ordinary backward accumulates at once

  TwoLayers block;
  block.checkpointed(x).square().sum().backward();
  EXPECT_TRUE(block.seen);  // not at the block's end
  expect_all_close(grads_of(*block.first), grads_of(*plain_run.first));
  expect_all_close(grads_of(*block.second), grads_of(*plain_run.second));
}

TEST(Checkpoint, GradOfTheParametersThroughABlockCapturesThemAndLeavesGradAlone) {
  const auto x = torch::randn({5, 8});
  TwoLayers plain_run, block;
  const auto expected = torch::autograd::grad({plain_run.forward(x).square().sum()},
                                              {plain_run.first->weight, plain_run.second->weight});
  const auto got = torch::autograd::grad({block.checkpointed(x).square().sum()},
                                         {block.first->weight, block.second->weight});
  expect_all_close(got, expected);
  EXPECT_FALSE(block.seen);
  for (const auto& p : block.params()) {
    EXPECT_FALSE(p.grad().defined());
  }
}

TEST(Checkpoint, BackwardWithInputsAccumulatesOnlyThoseNamed) {
  const auto x = torch::randn({5, 8});
  TwoLayers plain_run, block;
  plain_run.forward(x).square().sum().backward();
  torch::autograd::backward({block.checkpointed(x).square().sum()}, {}, c10::nullopt, false,
                            {block.second->weight});
  EXPECT_FALSE(block.first->weight.grad().defined());
  EXPECT_FALSE(block.second->bias.grad().defined());
  ASSERT_TRUE(block.second->weight.grad().defined());
  EXPECT_TRUE(torch::allclose(block.second->weight.grad(), plain_run.second->weight.grad()));
}

TEST(CudaCheckpoint, DropoutMasksMatchThePlainRun) {
  FRUGAL_SKIP_WITHOUT_CUDA();
  auto grad = [](bool checkpointed) {
    torch::manual_seed(42);
    auto x = torch::randn({20000}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
    auto inner = [](const torch::Tensor& t) { return torch::dropout(t * 3, 0.5, true); };
    auto h = torch::dropout(x, 0.5, true);
    auto y = checkpointed ? frugal::checkpoint(inner, h) : inner(h);
    y.sum().backward();
    return x.grad().cpu();
  };
  EXPECT_TRUE(torch::equal(grad(true), grad(false)));
}

std::vector<std::string> wrapped_by(frugal::CheckpointSelect select) {
  auto net = models::make_residual_mlp(4, 8, 16, 2);
  frugal::CheckpointPolicy policy(std::move(select));
  return policy.apply(*net);
}

TEST(CheckpointPolicy, ChoosesByNameTypeAndEveryNth) {
  using Names = std::vector<std::string>;
  EXPECT_EQ(wrapped_by(frugal::CheckpointSelect().types({"ResidualBlock"})),
            (Names{"0", "1", "2", "3"}));
  // Anywhere in the tree: the blocks' own layers too (the head is a Sequential child).
  EXPECT_EQ(wrapped_by(frugal::CheckpointSelect().types({"torch::nn::Linear"})),
            (Names{"0.fc1", "0.fc2", "1.fc1", "1.fc2", "2.fc1", "2.fc2", "3.fc1", "3.fc2", "4"}));
  EXPECT_EQ(wrapped_by(frugal::CheckpointSelect().every(2)), (Names{"1", "3"}));
  EXPECT_EQ(wrapped_by(frugal::CheckpointSelect().names({"2"})), (Names{"2"}));
}

TEST(CheckpointPolicy, FindsSequentialsInsideTheModelAndKeepsItsParameters) {
  struct NetImpl : torch::nn::Module {
    NetImpl() : blocks(register_module("blocks", models::make_residual_mlp(3, 8, 16, 8))) {}
    torch::Tensor forward(const torch::Tensor& x) { return blocks->forward(x).sum(1); }
    torch::nn::Sequential blocks;
  };
  torch::manual_seed(1);
  auto net = std::make_shared<NetImpl>();
  const auto before = net->parameters();
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().types({"ResidualBlock"}));
  EXPECT_EQ(policy.apply(*net), (std::vector<std::string>{"blocks.0", "blocks.1", "blocks.2"}));
  const auto after = net->parameters();
  ASSERT_EQ(before.size(), after.size());
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(before[i].is_same(after[i]));
  }
  EXPECT_TRUE(net->named_parameters().find("blocks.0.fc1.weight") != nullptr);  // not renamed
}

TEST(CheckpointPolicy, RunsPlainlyUnderNoGrad) {
  Counting counting;
  torch::nn::Sequential seq(counting);
  frugal::CheckpointPolicy policy(frugal::CheckpointSelect().every(1));
  policy.apply(*seq);
  auto x = torch::randn({3}, torch::requires_grad());
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(seq->forward(x).requires_grad());
  }
  EXPECT_EQ(counting->calls, 1);
  seq->forward(x).sum().backward();
  EXPECT_EQ(counting->calls, 3);  // forward, then the recompute
  policy.set_enabled(false);
  seq->forward(x).sum().backward();
  EXPECT_EQ(counting->calls, 4);  // plain: no recompute
}

}  // namespace
