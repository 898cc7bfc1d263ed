#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "frugal/memory/ledger.h"
#include "memory/module_tensors.h"
#include "memory/state_tensors.h"

namespace {

using frugal::detail::ModuleTensors;

// A module whose buffer can be replaced: assigning to the reference register_buffer returns
// puts another tensor in the module's dictionary (C++ has no re-registering).
struct WithBuffer : torch::nn::Module {
  WithBuffer() : table(register_buffer("table", torch::zeros({1000}))) {
    fc = register_module("fc", torch::nn::Linear(16, 4));
  }
  torch::Tensor& table;
  torch::nn::Linear fc{nullptr};
};

void expect_same(const frugal::Ledger& a, const frugal::Ledger& b) {
  EXPECT_EQ(a.weights, b.weights);
  EXPECT_EQ(a.gradients, b.gradients);
  EXPECT_EQ(a.optimizer, b.optimizer);
  EXPECT_EQ(a.other, b.other);
  EXPECT_EQ(a.allocated, b.allocated);
}

TEST(ModuleTensors, LedgerMatchesAWalkOfTheModuleThroughATrainingStep) {
  frugal::MemoryProbe probe(torch::kCPU);
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::BatchNorm1d(32),
                              torch::nn::ReLU(), torch::nn::Linear(32, 2));
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  ModuleTensors tensors(*model);
  expect_same(frugal::detail::measure_ledger(probe.snapshot(), tensors, &adam),
              frugal::measure_ledger(probe, *model, &adam));
  model->forward(torch::randn({6, 8})).sum().backward();
  adam.step();
  const auto cached = frugal::detail::measure_ledger(probe.snapshot(), tensors, &adam);
  expect_same(cached, frugal::measure_ledger(probe, *model, &adam));
  EXPECT_GT(cached.gradients, 0);
  EXPECT_EQ(cached.optimizer, 2 * (cached.gradients));  // Adam: two moments a parameter
}

TEST(ModuleTensors, AReplacedBufferIsNotKeptAliveAndIsCountedAfresh) {
  frugal::MemoryProbe probe(torch::kCPU);
  auto module = std::make_shared<WithBuffer>();
  ModuleTensors tensors(*module);
  const auto before = frugal::detail::measure_ledger(probe.snapshot(), tensors, nullptr);
  const auto allocated = probe.allocated();

  module->table = torch::zeros({3000});  // the old one has no owner left
  // The old 4000 bytes are gone: the list held them weakly.
  EXPECT_EQ(probe.allocated(), allocated - 4 * 1000 + 4 * 3000);
  const auto after = frugal::detail::measure_ledger(probe.snapshot(), tensors, nullptr);
  EXPECT_EQ(after.weights, before.weights - 4 * 1000 + 4 * 3000);
  expect_same(after, frugal::measure_ledger(probe, *module));
}

TEST(ModuleTensors, RefreshReadsParametersRegisteredLater) {
  frugal::MemoryProbe probe(torch::kCPU);
  auto module = std::make_shared<WithBuffer>();
  ModuleTensors tensors(*module);
  const auto before = frugal::detail::measure_ledger(probe.snapshot(), tensors, nullptr).weights;
  module->register_parameter("extra", torch::ones({50}));
  // Nothing it held was freed, so the list stands as read, until refreshed.
  EXPECT_EQ(frugal::detail::measure_ledger(probe.snapshot(), tensors, nullptr).weights, before);
  tensors.refresh();
  EXPECT_EQ(frugal::detail::measure_ledger(probe.snapshot(), tensors, nullptr).weights,
            before + 4 * 50);
}

TEST(Ledger, ManyTensorsAndTheirViewsCountEachStorageOnce) {
  // More tensors than the ledger's short list holds: the count goes on in a set.
  frugal::MemoryProbe probe(torch::kCPU);
  torch::nn::Module many;
  std::int64_t bytes = 0;
  for (int i = 0; i < 150; ++i) {
    auto p = many.register_parameter(fmt::format("p{}", i), torch::randn({i + 1}));
    many.register_buffer(fmt::format("view{}", i), p.detach().narrow(0, 0, 1));
    bytes += 4 * (i + 1);
  }
  EXPECT_EQ(frugal::measure_ledger(probe, many).weights, bytes);
  ModuleTensors tensors(many);
  EXPECT_EQ(frugal::detail::measure_ledger(probe.snapshot(), tensors, nullptr).weights, bytes);
}

std::vector<const void*> impls(const std::vector<torch::Tensor>& tensors) {
  std::vector<const void*> out;
  for (const auto& t : tensors) {
    out.push_back(t.defined() ? t.unsafeGetTensorImpl() : nullptr);
  }
  return out;
}

std::vector<const void*> visited(const torch::optim::OptimizerParamState& state) {
  std::vector<torch::Tensor> seen;
  frugal::detail::for_each_state_tensor(state, [&](const torch::Tensor& t) { seen.push_back(t); });
  return impls(seen);
}

// A state of a type LibTorch does not know, found through what it derives from.
struct TaggedAdamState : torch::optim::AdamParamState {};
struct ListedState : torch::optim::OptimizerCloneableParamState<ListedState>,
                     frugal::StateTensorList {
  torch::Tensor a = torch::ones({2}), b = torch::zeros({3});
  std::vector<torch::Tensor> state_tensors() const override { return {a, b}; }
};

TEST(StateTensors, VisitsEachStateTypesTensorsInOrder) {
  torch::manual_seed(0);
  torch::nn::Linear layer(4, 3);
  torch::optim::SGD sgd(layer->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::Adam adam(layer->parameters(), torch::optim::AdamOptions(1e-3).amsgrad(true));
  torch::optim::AdamW adamw(layer->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::Adagrad adagrad(layer->parameters(), torch::optim::AdagradOptions(0.1));
  layer->forward(torch::randn({2, 4})).sum().backward();
  for (torch::optim::Optimizer* o :
       std::initializer_list<torch::optim::Optimizer*>{&sgd, &adam, &adamw, &adagrad}) {
    o->step();
    ASSERT_EQ(o->state().size(), 2u);
  }
  for (const auto& [key, state] : sgd.state()) {
    const auto& s = static_cast<const torch::optim::SGDParamState&>(*state);
    EXPECT_EQ(visited(s), impls({s.momentum_buffer()}));
  }
  for (const auto& [key, state] : adam.state()) {
    const auto& s = static_cast<const torch::optim::AdamParamState&>(*state);
    EXPECT_EQ(visited(s), impls({s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}));
    EXPECT_EQ(impls(frugal::optimizer_state_tensors(s)), visited(s));
  }
  for (const auto& [key, state] : adamw.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    EXPECT_EQ(visited(s), impls({s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}));
  }
  for (const auto& [key, state] : adagrad.state()) {
    const auto& s = static_cast<const torch::optim::AdagradParamState&>(*state);
    EXPECT_EQ(visited(s), impls({s.sum()}));
  }
  TaggedAdamState tagged;
  tagged.exp_avg(torch::ones({2}));
  tagged.exp_avg_sq(torch::ones({2}));
  EXPECT_EQ(visited(tagged), impls({tagged.exp_avg(), tagged.exp_avg_sq(), torch::Tensor()}));
  const ListedState listed;
  EXPECT_EQ(visited(listed), impls({listed.a, listed.b}));
}

}  // namespace
