// A trainer's parts without the trainer: the state they share over a small model, a port
// for the policies, and the whole batch's gradients to compare with.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "helpers.h"
#include "train/policy_set.h"
#include "train/step_runner.h"
#include "train/step_state.h"

namespace frugal::testing {

/// What a policy may use of the engine, for parts run without a Trainer.
class PartsPort : public PolicyPort {
 public:
  explicit PartsPort(detail::StepState& state) : s_(state) {}
  torch::nn::Module& module() override { return *s_.module; }
  torch::optim::Optimizer& optimizer() override { return s_.optimizer; }
  const MemoryProbe& probe() const override { return s_.probe; }
  std::int64_t micro_batch() const override { return s_.counters.micro_batch; }
  void set_micro_batch(std::int64_t size) override { s_.counters.micro_batch = size; }
  std::int64_t eval_batch() const override { return s_.counters.eval_batch; }
  void set_eval_batch(std::int64_t size) override { s_.counters.eval_batch = size; }
  std::int64_t steps() const override { return s_.counters.steps; }
  std::int64_t skipped_steps() const override { return s_.counters.skipped; }
  void set_unscale(Unscale) override {}
  void unscale_gradients() override {}

 private:
  detail::StepState& s_;
};

/// An MLP (6 -> 8 -> 3) under SGD and cross-entropy, and the state a trainer of it with
/// `options` shares among its parts; no policies yet.
struct StepParts {
  explicit StepParts(TrainerOptions options = {}, double lr = 0.1)
      : model(make_mlp(6, 8, 3)),
        sgd(model->parameters(), torch::optim::SGDOptions(lr)),
        state(model.ptr(), sgd, forward_of(model), cross_entropy(), nullptr, std::move(options)),
        policies(Traits{}),
        port(state) {}

  static Trainer::BatchForwardFn forward_of(torch::nn::Sequential m) {
    return [module = m.ptr()](const Batch& b) { return module->forward(b.inputs); };
  }
  static Trainer::OutputLossFn cross_entropy() {
    return [](const torch::Tensor& out, const Batch& b) {
      return torch::nn::functional::cross_entropy(out, b.targets);
    };
  }
  /// `n` samples of 6 features and 3 classes, the same for the same seed.
  static Batch batch(std::int64_t n, std::uint64_t seed = 11) {
    torch::manual_seed(seed);
    return {torch::randn({n, 6}), torch::randint(0, 3, {n})};
  }
  /// The mean loss over `batches` run as one, and its gradients, by one plain backward;
  /// the parameters keep the gradients they had.
  std::pair<double, std::vector<torch::Tensor>> whole(const std::vector<Batch>& batches) {
    std::vector<torch::Tensor> inputs, targets;
    for (const auto& b : batches) {
      inputs.push_back(b.inputs);
      targets.push_back(b.targets);
    }
    std::vector<torch::Tensor> held;
    for (auto& p : model->parameters()) {
      held.push_back(p.grad());
      p.mutable_grad() = torch::Tensor();
    }
    const auto loss = torch::nn::functional::cross_entropy(model->forward(torch::cat(inputs)),
                                                           torch::cat(targets));
    loss.backward();
    auto grads = grads_of(*model);
    auto params = model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = held[i];
    }
    return {loss.item<double>(), grads};
  }
  /// Runs `b` forward and backward as a step's runner does; returns the report.
  StepReport run(const Batch& b, bool isolate = false) {
    state.plan.split_into(b, state.counters.micro_batch, state.split);
    StepReport report;
    StepContext ctx(port, b, report);
    detail::StepRunner(state, policies).run(ctx, isolate);
    state.split.clear();
    return report;
  }

  torch::nn::Sequential model;
  torch::optim::SGD sgd;
  detail::StepState state;
  detail::PolicySet policies;
  PartsPort port;
};

}  // namespace frugal::testing
