// Loop::backward_step: the optimizer step fused into a model's last backward gives the
// parameters and optimizer state of backward-then-step bit for bit, never holds the
// model's gradients all at once (the probe's peak says by how much), skips on a NaN loss
// without changing anything, names what it refuses, and names what a failed backward
// had already updated.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "compat.h"
#include "frugal/distributed/group.h"
#include "frugal/distributed/reducer.h"
#include "frugal/error.h"
#include "frugal/loop/loop.h"
#include "frugal/memory/probe.h"
#include "frugal/optim/adam.h"
#include "frugal/policy/grad_scaler.h"
#include "helpers.h"

namespace {
namespace loop_backward_step {  // helper names of its own in the unity build

// A trunk and two heads: the first loss trains the trunk and head `a`, the last the trunk
// and head `b`, so `a`'s gradient comes only from the earlier backward.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl(std::int64_t width, int depth)
      : trunk(register_module("trunk", torch::nn::Sequential(torch::nn::Linear(8, width)))),
        a(register_module("a", torch::nn::Linear(width, 2))),
        b(register_module("b", torch::nn::Linear(width, 2))) {
    for (int i = 0; i < depth; ++i) {
      trunk->push_back(torch::nn::Tanh());
      trunk->push_back(torch::nn::Linear(width, width));
    }
  }
  torch::nn::Sequential trunk;
  torch::nn::Linear a, b;
};
TORCH_MODULE(TwoHeads);

struct Run {
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> state;  // Adam's moments, in parameter order
  std::vector<std::int64_t> peaks, allocated;
};

// `earlier`: a first backward (head `a`) before the last one; without it the last backward is
// the iteration's only one. Peaks and allocated bytes are counted from what the thread held
// before the model was made.
Run train(bool fused, std::int64_t width = 32, int depth = 1, int iterations = 4,
          bool earlier = true) {
  const frugal::MemoryProbe probe(torch::kCPU, frugal::MemoryScope::Thread);
  const auto base = probe.allocated();
  torch::manual_seed(17);
  TwoHeads net(width, depth);
  frugal::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
  frugal::Loop loop;
  auto& m = loop.prepare(net, adam, "net");
  Run run;
  for (int i = 0; i < iterations; ++i) {
    const auto x = torch::randn({4, 8});
    auto h = net->trunk->forward(x);
    if (earlier) {
      loop.backward(net->a->forward(h).pow(2).mean(), m, /*retain_graph=*/true);
    }
    auto last = (net->b->forward(h) - 1).pow(2).mean();
    if (fused) {
      EXPECT_TRUE(loop.backward_step(last, m));
    } else {
      loop.backward(last, m);
      EXPECT_TRUE(loop.step(m));
    }
    h = torch::Tensor();
    last = torch::Tensor();
    const auto r = loop.end();
    run.peaks.push_back(r.peak - base);
    run.allocated.push_back(r.memory.allocated - base);
  }
  for (const auto& p : net->parameters()) {
    run.params.push_back(p.detach().clone());
    const auto it = adam.state().find(frugal::compat::optimizer_state_key(p));
    if (it == adam.state().end()) {
      continue;  // never stepped (head a, without the earlier backward)
    }
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    run.state.push_back(s.exp_avg().clone());
    run.state.push_back(s.exp_avg_sq().clone());
  }
  EXPECT_EQ(m.steps(), iterations);
  return run;
}

TEST(LoopBackwardStep, EqualsBackwardThenStepBitForBit) {
  const auto plain = train(false);
  const auto fused = train(true);
  ASSERT_EQ(plain.params.size(), fused.params.size());
  for (std::size_t i = 0; i < plain.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain.params[i], fused.params[i])) << "parameter " << i;
  }
  for (std::size_t i = 0; i < plain.state.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain.state[i], fused.state[i])) << "state tensor " << i;
  }
}

TEST(LoopBackwardStep, TheGradientsNeverExistAllAtOnce) {
  // Six equal layers of 256 KiB of gradient each.
  constexpr std::int64_t kWidth = 256;
  const auto plain = train(false, kWidth, 6, 3, /*earlier=*/false);
  const auto fused = train(true, kWidth, 6, 3, /*earlier=*/false);
  std::int64_t grad_bytes = -(2 * kWidth + 2) * 4;  // head a's: the last backward misses it
  for (const auto& p : plain.params) {
    grad_bytes += p.numel() * 4;
  }
  // After the first iteration (Adam's state made), the fused step's peak lacks most of the
  // gradients: at most one parameter's is alive with the rest of the iteration's tensors.
  for (std::size_t i = 1; i < plain.peaks.size(); ++i) {
    EXPECT_GE(plain.peaks[i] - fused.peaks[i], grad_bytes / 2)
        << "iteration " << i + 1 << ": peak " << plain.peaks[i] << " plain, " << fused.peaks[i]
        << " fused, gradients " << grad_bytes;
    EXPECT_EQ(plain.allocated[i], fused.allocated[i]) << "iteration " << i + 1;
  }
}

TEST(LoopBackwardStep, ANonFiniteLossSkipsTheStepAndChangesNothing) {
  torch::nn::Linear model(4, 2);
  frugal::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  frugal::Loop loop;
  auto& m = loop.prepare(model, adam, "model");
  const auto before = model->weight.detach().clone();
  EXPECT_FALSE(loop.backward_step(model->forward(torch::ones({2, 4})).sum() * std::nan(""), m));
  EXPECT_TRUE(torch::equal(model->weight, before));
  EXPECT_TRUE(adam.state().empty());
  EXPECT_EQ(m.skipped_steps(), 1);
  EXPECT_FALSE(model->weight.grad().defined());
}

TEST(LoopBackwardStep, RefusesWhatNeedsEveryGradientFirst) {
  torch::nn::Linear model(4, 2);
  torch::optim::Adam torch_adam(model->parameters(), 0.1);
  frugal::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  auto loss = [&] { return model->forward(torch::ones({2, 4})).sum(); };
  {
    frugal::Loop loop;
    auto& m = loop.prepare(model, torch_adam, "model");
    frugal::testing::expect_error_contains([&] { loop.backward_step(loss(), m); },
                                           "its optimizer is torch::optim::Adam");
  }
  {
    frugal::Loop loop(frugal::LoopOptions().scaler(std::make_shared<frugal::GradScaler>()));
    auto& m = loop.prepare(model, adam, "model");
    frugal::testing::expect_error_contains([&] { loop.backward_step(loss(), m); },
                                           "the loop's loss scaler needs every gradient");
  }
  {
    frugal::Loop loop(
        frugal::LoopOptions().reducer(
            std::make_shared<frugal::distributed::Reducer>(frugal::distributed::Group::single())));
    auto& m = loop.prepare(model, adam, "model");
    frugal::testing::expect_error_contains([&] { loop.backward_step(loss(), m); },
                                           "the loop's reducer needs every gradient");
  }
  {
    frugal::Loop loop;
    auto& m = loop.prepare(model, adam, "model");
    const auto before = model->weight.detach().clone();
    frugal::testing::expect_error_contains(
        [&] {
          torch::NoGradGuard no_grad;
          loop.backward_step(loss(), m);
        },
        "Loop::backward_step of 'model': the loss does not require grad");
    EXPECT_TRUE(torch::equal(model->weight, before));
    EXPECT_EQ(m.steps(), 0);
  }
  EXPECT_FALSE(model->weight.grad().defined());  // nothing ran
}

// Passes values through; its backward fails, after the layers behind it were updated.
struct FailingBackward : torch::autograd::Function<FailingBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error("backward lost its device");
  }
};

TEST(LoopBackwardStep, AFailedBackwardNamesTheParametersItHadUpdated) {
  torch::manual_seed(5);
  torch::nn::Linear first(4, 4), second(4, 1);
  torch::nn::Sequential net(first, second);
  frugal::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.1));
  frugal::Loop loop;
  auto& m = loop.prepare(net, adam, "net");
  const auto first_before = first->weight.detach().clone();
  const auto second_before = second->weight.detach().clone();
  auto h = FailingBackward::apply(first->forward(torch::randn({3, 4})));
  try {
    loop.backward_step(second->forward(h).pow(2).mean(), m);
    FAIL() << "the failing backward went through";
  } catch (const frugal::PartialStepError& e) {
    auto updated = e.updated;
    std::sort(updated.begin(), updated.end());
    EXPECT_EQ(updated, (std::vector<std::string>{"1.bias", "1.weight"})) << e.what();
    EXPECT_NE(std::string(e.what()).find("backward lost its device"), std::string::npos);
  }
  EXPECT_TRUE(torch::equal(first->weight, first_before));
  EXPECT_FALSE(torch::equal(second->weight, second_before));
  EXPECT_FALSE(loop.pending());
}

}  // namespace loop_backward_step
}  // namespace
