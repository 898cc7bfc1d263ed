// Trainer::evaluate: loss and accuracy under no_grad, in its own batch size.
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "../memory/module_tensors.h"
#include "frugal/error.h"
#include "frugal/memory/memory_context.h"
#include "frugal/optim/sharded.h"
#include "frugal/train/sink.h"
#include "frugal/train/trainer.h"
#include "internal.h"
#include "trainer_impl.h"

namespace frugal {
namespace detail {

c10::optional<std::pair<std::int64_t, std::int64_t>> class_hits(const torch::Tensor& output,
                                                                const torch::Tensor& targets,
                                                                std::int64_t ignore_index) {
  if (!targets.defined() || targets.is_floating_point() || output.dim() != targets.dim() + 1) {
    return c10::nullopt;
  }
  // Classes last ([N, T, C] against [N, T]), or in dimension 1 as cross_entropy takes them
  // ([N, C] against [N], [N, C, T] against [N, T]).
  auto same_except = [&](std::int64_t dim) {
    auto sizes = output.sizes().vec();
    sizes.erase(sizes.begin() + dim);
    return sizes == targets.sizes().vec();
  };
  std::int64_t dim = -1;
  if (same_except(output.dim() - 1)) {
    dim = output.dim() - 1;
  } else if (output.dim() >= 2 && same_except(1)) {
    dim = 1;
  } else {
    return c10::nullopt;
  }
  const auto scored = targets.ne(ignore_index);
  const auto hits = output.argmax(dim).eq(targets).logical_and(scored);
  return std::make_pair(hits.sum().item<std::int64_t>(), scored.sum().item<std::int64_t>());
}

}  // namespace detail

EvalReport Trainer::evaluate(const Batch& data, c10::optional<std::int64_t> batch_size) {
  return evaluate(data, EvaluateOptions().batch_size(batch_size));
}

EvalReport Trainer::evaluate(const Batch& data, const EvaluateOptions& options) {
  auto report = impl_->evaluate_chunks(*this, data, options.batch_size());
  if (options.combine()) {
    options.combine()(report);
  }
  for (auto& sink : impl_->sinks) {
    sink->write(report);
  }
  return report;
}

EvalReport Trainer::evaluate_each(const std::function<c10::optional<Batch>()>& next,
                                  const EvaluateOptions& options) {
  FRUGAL_CHECK(next != nullptr, "frugal: evaluate_each needs a source of batches");
  EvalReport all;
  std::int64_t hits = 0;  // argmax hits, as each part's accuracy x its scored targets
  bool classes = true;
  double time_ms = 0;
  while (auto batch = next()) {
    const auto part = impl_->evaluate_chunks(*this, *batch, options.batch_size());
    const auto count = all.count + part.count;
    all.loss = count > 0 ? (all.loss * static_cast<double>(all.count) +
                            part.loss * static_cast<double>(part.count)) /
                               static_cast<double>(count)
                         : 0.0;
    classes = classes && part.accuracy >= 0;
    hits += classes ? std::llround(part.accuracy * static_cast<double>(part.scored)) : 0;
    all.count = count;
    all.scored += part.scored;
    all.samples += part.samples;
    all.batches += part.batches;
    all.oom_retries += part.oom_retries;
    all.peak = std::max(all.peak, part.peak);
    all.step = part.step;
    all.batch_size = part.batch_size;
    all.memory = part.memory;
    all.ledger = part.ledger;
    time_ms += part.time_ms;
  }
  FRUGAL_CHECK(all.batches > 0, "frugal: evaluate() got no batches");
  all.accuracy =
      classes && all.scored > 0 ? static_cast<double>(hits) / static_cast<double>(all.scored) : -1;
  all.scored = classes ? all.scored : 0;
  all.time_ms = time_ms;
  if (options.combine()) {
    options.combine()(all);
  }
  for (auto& sink : impl_->sinks) {
    sink->write(all);
  }
  return all;
}

EvalReport Trainer::Impl::evaluate_chunks(PolicyPort& port, const Batch& data,
                                          c10::optional<std::int64_t> batch_size) {
  const auto start = detail::Clock::now();
  const std::int64_t samples = data.size();
  FRUGAL_CHECK(samples > 0, "frugal: evaluate() got an empty batch (0 samples)");
  detail::check_positive(batch_size, "the evaluation batch size");
  std::int64_t size = batch_size.value_or(
      state.counters.eval_batch > 0 ? state.counters.eval_batch : state.counters.micro_batch);
  size = size > 0 ? std::min(size, samples) : samples;

  EvalReport report;
  report.step = state.counters.steps;
  report.samples = samples;

  const bool was_training = state.module->is_training();
  state.module->eval();
  struct RestoreMode {
    torch::nn::Module& m;
    bool training;
    ~RestoreMode() { m.train(training); }
  } restore{*state.module, was_training};
  // Parameters sharded between steps (ZeRO-3) are gathered for the evaluation (units one
  // at a time, as they are called).
  std::unique_ptr<optim::GatheredParameters> whole;
  if (state.sharded != nullptr) {
    whole = std::make_unique<optim::GatheredParameters>(
        *state.sharded, optim::GatheredParameters::What::ForForward);
  }
  std::unique_ptr<torch::NoGradGuard> no_grad;
  std::unique_ptr<c10::InferenceMode> inference;
  if (state.options.inference_mode()) {
    inference = std::make_unique<c10::InferenceMode>();
  } else {
    no_grad = std::make_unique<torch::NoGradGuard>();
  }

  // The policies' evaluation scopes (autocast), ended in reverse order however it ends.
  const detail::PolicySet::Evaluation scopes(policies, port);

  const PhaseScope phase(MemoryPhase::Evaluation);
  ScopedPeak peak(state.probe);
  double loss_sum = 0;
  std::int64_t correct = 0;
  std::int64_t scored = 0;
  std::int64_t total = 0;
  bool classes = state.forward != nullptr;
  const bool mean = state.options.reduction() == LossReduction::Mean;
  for (std::int64_t offset = 0; offset < samples;) {
    const std::int64_t n = std::min(size, samples - offset);
    try {
      const auto micro = data.slice(offset, n).to(state.options.device());
      const std::int64_t count = state.plan.count(micro);
      torch::Tensor loss;
      if (state.forward) {
        const auto output = state.forward(micro);
        loss = state.loss(output, micro);
        const auto hits = detail::class_hits(output, micro.targets, state.options.ignore_index());
        classes = classes && hits.has_value();
        if (classes) {
          correct += hits->first;
          scored += hits->second;
        }
      } else {
        loss = state.batch_loss(micro);
      }
      if (!mean || count > 0) {  // a chunk that counts nothing (all padding) weighs nothing
        loss_sum += loss.item<double>() * state.window.share(count);
      }
      total += count;
      ++report.batches;
      offset += n;
    } catch (const std::exception& error) {
      // A policy may shrink the evaluation batch; evaluation goes on from this chunk.
      const bool retry = policies.eval_retry(port, size, error);
      if (!retry) {
        throw;
      }
      size = std::min(state.counters.eval_batch, size);
      ++report.oom_retries;
    }
  }
  report.batch_size = size;
  report.count = total;
  report.loss = total > 0 ? loss_sum / static_cast<double>(total) : 0.0;
  report.scored = classes ? scored : 0;
  report.accuracy =
      classes && scored > 0 ? static_cast<double>(correct) / static_cast<double>(scored) : -1;
  report.peak = peak.end();
  report.memory = state.probe.snapshot();
  if (state.options.ledger()) {
    report.ledger = detail::measure_ledger(report.memory, state.module_tensors, &state.optimizer);
  }
  report.time_ms = detail::ms_since(start, state.options.device());
  return report;
}

}  // namespace frugal
