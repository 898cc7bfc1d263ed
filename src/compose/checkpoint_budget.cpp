#include "frugal/compose/checkpoint_budget.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "checkpoint_observer.h"
#include "frugal/error.h"
#include "frugal/memory/format.h"
#include "engine/clock.h"

namespace frugal {
namespace {

using detail::Clock;
using detail::ms_since;

std::int64_t bytes_of(const std::vector<torch::Tensor>& tensors) {
  std::int64_t n = 0;
  for (const auto& t : tensors) {
    n += t.defined() ? static_cast<std::int64_t>(t.nbytes()) : 0;
  }
  return n;
}

// Watches every named checkpoint of a step: each block's forward, recompute and backward,
// and the peak of the step outside the blocks' backward.
class Measurement : public CheckpointObserver {
 public:
  explicit Measurement(const MemoryProbe& probe)
      : probe_(probe), outside_(std::make_unique<ScopedPeak>(probe)) {
    previous_ = set_checkpoint_observer(this);
  }
  ~Measurement() override { set_checkpoint_observer(previous_); }
  Measurement(const Measurement&) = delete;
  Measurement& operator=(const Measurement&) = delete;

  void on(CheckpointPhase phase, const std::string& name,
          const std::vector<torch::Tensor>& outputs) override {
    if (name.empty()) {
      return;  // a checkpoint of the program's own, inside a block or not: not a choice
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto& b = block(name);
    switch (phase) {
      case CheckpointPhase::ForwardBegin:
        b.started = now();
        break;
      case CheckpointPhase::ForwardEnd:
        b.cost.forward_ms += ms_since(b.started, probe_.device());
        b.cost.output_bytes = std::max(b.cost.output_bytes, bytes_of(outputs));
        break;
      case CheckpointPhase::RecomputeBegin:
        end_outside();
        b.base = probe_.allocated();
        b.cost.backward_base = std::max(b.cost.backward_base, b.base);
        b.whole = std::make_unique<ScopedPeak>(probe_);
        b.started = now();
        break;
      case CheckpointPhase::RecomputeEnd:
        b.cost.recompute_ms += ms_since(b.started, probe_.device());
        b.recomputed = probe_.allocated();
        b.recomputed_outputs = bytes_of(outputs);
        b.backward = std::make_unique<ScopedPeak>(probe_);
        b.started = now();
        break;
      case CheckpointPhase::BackwardEnd: {
        b.cost.backward_ms += ms_since(b.started, probe_.device());
        const auto kept = b.recomputed - b.base;
        const auto backward_peak = b.backward->end() - b.recomputed;
        b.cost.kept_bytes = std::max(b.cost.kept_bytes, kept - b.recomputed_outputs);
        b.cost.plain_peak = std::max(b.cost.plain_peak, kept + backward_peak);
        b.cost.checkpointed_peak = std::max(b.cost.checkpointed_peak, b.whole->end() - b.base);
        b.whole.reset();
        b.backward.reset();
        outside_ = std::make_unique<ScopedPeak>(probe_);
        break;
      }
    }
  }

  // The blocks in the order of their first forward, and the outside peak so far.
  std::vector<BlockCost> blocks() const {
    std::vector<BlockCost> out;
    for (const auto& name : order_) {
      out.push_back(blocks_.at(name).cost);
    }
    return out;
  }
  std::int64_t outside_peak() {
    end_outside();
    return outside_peak_;
  }

 private:
  struct Block {
    BlockCost cost;
    Clock::time_point started;
    std::int64_t base = 0, recomputed = 0, recomputed_outputs = 0;
    std::unique_ptr<ScopedPeak> whole, backward;
  };

  // The clock once the device has done the work queued before (on CUDA).
  Clock::time_point now() const {
    detail::wait_for(probe_.device());
    return Clock::now();
  }

  Block& block(const std::string& name) {
    auto found = blocks_.find(name);
    if (found == blocks_.end()) {
      order_.push_back(name);
      found = blocks_.emplace(name, Block{}).first;
      found->second.cost.name = name;
    }
    return found->second;
  }
  void end_outside() {
    if (outside_) {
      outside_peak_ = std::max(outside_peak_, outside_->end());
      outside_.reset();
    }
  }

  const MemoryProbe& probe_;
  CheckpointObserver* previous_ = nullptr;
  std::mutex mutex_;
  std::vector<std::string> order_;
  std::map<std::string, Block> blocks_;
  std::unique_ptr<ScopedPeak> outside_;
  std::int64_t outside_peak_ = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// The blocks of several measured steps as one: bytes the highest, times the median.
std::vector<BlockCost> combined(const std::vector<std::vector<BlockCost>>& trials) {
  std::vector<BlockCost> out = trials.front();
  for (std::size_t j = 0; j < out.size(); ++j) {
    auto& b = out[j];
    std::vector<double> forward, recompute, backward;
    for (const auto& t : trials) {
      FRUGAL_CHECK(t.size() == out.size() && t[j].name == b.name,
                   "frugal: plan_checkpoints: the measured steps ran different blocks (", t.size(),
                   " and ", out.size(), ")");
      b.output_bytes = std::max(b.output_bytes, t[j].output_bytes);
      b.kept_bytes = std::max(b.kept_bytes, t[j].kept_bytes);
      b.backward_base = std::max(b.backward_base, t[j].backward_base);
      b.checkpointed_peak = std::max(b.checkpointed_peak, t[j].checkpointed_peak);
      b.plain_peak = std::max(b.plain_peak, t[j].plain_peak);
      forward.push_back(t[j].forward_ms);
      recompute.push_back(t[j].recompute_ms);
      backward.push_back(t[j].backward_ms);
    }
    b.forward_ms = median(forward);
    b.recompute_ms = median(recompute);
    b.backward_ms = median(backward);
  }
  return out;
}

// Which part of the step is over `limit` with every block checkpointed.
std::string over_limit(const std::vector<BlockCost>& blocks, std::int64_t outside_peak,
                       std::int64_t limit) {
  std::string parts;
  for (const auto& b : blocks) {
    const auto peak = b.backward_base + b.checkpointed_peak;
    if (peak > limit) {
      parts += fmt::format("{}the backward of '{}' reaches {}", parts.empty() ? "" : "; ", b.name,
                           format_bytes(peak));
    }
  }
  if (outside_peak > limit) {
    parts += fmt::format(
        "{}the step outside the blocks' backward (forward, loss, head) "
        "reaches {}",
        parts.empty() ? "" : "; ", format_bytes(outside_peak));
  }
  return fmt::format(
      "no choice of checkpointed blocks fits {}: with every block "
      "checkpointed {}",
      format_bytes(limit), parts);
}

}  // namespace

std::int64_t predicted_checkpoint_peak(const std::vector<BlockCost>& blocks,
                                       std::int64_t outside_peak,
                                       const std::vector<bool>& checkpointed) {
  FRUGAL_CHECK(checkpointed.size() == blocks.size(), "frugal: a checkpoint choice of ",
               checkpointed.size(), " blocks for ", blocks.size(), " blocks");
  std::int64_t kept = 0;  // by the plain blocks before this one
  std::int64_t peak = 0;
  for (std::size_t j = 0; j < blocks.size(); ++j) {
    const auto& b = blocks[j];
    peak = std::max(
        peak, b.backward_base + kept + (checkpointed[j] ? b.checkpointed_peak : b.plain_peak));
    kept += checkpointed[j] ? 0 : b.kept_bytes;
  }
  return std::max(peak, outside_peak + kept);
}

std::vector<bool> choose_checkpoints(const std::vector<BlockCost>& blocks,
                                     std::int64_t outside_peak, std::int64_t limit,
                                     std::int64_t buckets) {
  FRUGAL_CHECK(limit > 0, "frugal: the checkpoint budget must be > 0 bytes, got ", limit);
  FRUGAL_CHECK(buckets >= 1, "frugal: choose_checkpoints needs buckets >= 1, got ", buckets);
  const std::int64_t quantum = std::max<std::int64_t>(1, (limit + buckets - 1) / buckets);
  const auto states = static_cast<std::size_t>(limit / quantum + 1);
  constexpr double kNone = std::numeric_limits<double>::infinity();
  const std::size_t n = blocks.size();
  // cost[s]: the least added forward time of the blocks so far whose plain ones keep s
  // quanta; plain[j][s]: whether block j was plain on the way to s.
  std::vector<double> cost(states, kNone), next(states);
  std::vector<std::vector<bool>> plain(n, std::vector<bool>(states, false));
  cost[0] = 0;
  // Each block's kept bytes in quanta, rounded up.
  std::vector<std::size_t> weights(n);
  for (std::size_t j = 0; j < n; ++j) {
    weights[j] = static_cast<std::size_t>(
        (std::max<std::int64_t>(0, blocks[j].kept_bytes) + quantum - 1) / quantum);
  }
  for (std::size_t j = 0; j < n; ++j) {
    const auto& b = blocks[j];
    const auto weight = weights[j];
    std::fill(next.begin(), next.end(), kNone);
    for (std::size_t s = 0; s < states; ++s) {
      if (cost[s] == kNone) {
        continue;
      }
      const auto base = b.backward_base + static_cast<std::int64_t>(s) * quantum;
      if (base + b.checkpointed_peak <= limit && cost[s] + b.forward_ms < next[s]) {
        next[s] = cost[s] + b.forward_ms;
        plain[j][s] = false;
      }
      const auto to = s + weight;
      if (base + b.plain_peak <= limit && to < states && cost[s] < next[to]) {
        next[to] = cost[s];
        plain[j][to] = true;
      }
    }
    cost.swap(next);
  }
  std::size_t best = states;
  for (std::size_t s = 0; s < states; ++s) {
    const bool fits = outside_peak + static_cast<std::int64_t>(s) * quantum <= limit;
    if (fits && cost[s] != kNone && (best == states || cost[s] < cost[best])) {
      best = s;
    }
  }
  if (best == states) {
    return {};
  }
  std::vector<bool> checkpointed(n, true);
  for (std::size_t j = n; j-- > 0;) {
    if (plain[j][best]) {
      checkpointed[j] = false;
      best -= weights[j];
    }
  }
  return checkpointed;
}

std::vector<std::string> CheckpointBudgetPlan::chosen() const {
  std::vector<std::string> names;
  for (std::size_t j = 0; j < blocks.size() && j < checkpointed.size(); ++j) {
    if (checkpointed[j]) {
      names.push_back(blocks[j].name);
    }
  }
  return names;
}

std::string CheckpointBudgetPlan::table() const {
  std::string out =
      "| block | outputs | kept if plain | backward starts at | peak checkpointed | peak plain "
      "| forward ms | recompute ms | choice |\n|---|---|---|---|---|---|---|---|---|\n";
  for (std::size_t j = 0; j < blocks.size(); ++j) {
    const auto& b = blocks[j];
    out += fmt::format("| {} | {} | {} | {} | {} | {} | {:.2f} | {:.2f} | {} |\n", b.name,
                       format_bytes(b.output_bytes), format_bytes(b.kept_bytes),
                       format_bytes(b.backward_base), format_bytes(b.checkpointed_peak),
                       format_bytes(b.plain_peak), b.forward_ms, b.recompute_ms,
                       j < checkpointed.size() && checkpointed[j] ? "checkpoint" : "plain");
  }
  out += fmt::format(
      "\nbudget {} (margin {:.0f}%); every block checkpointed: peak {}, "
      "{:.1f} ms; outside the blocks' backward {}\n",
      format_bytes(budget), margin * 100, format_bytes(all_checkpointed_peak), all_checkpointed_ms,
      format_bytes(outside_peak));
  if (!fits) {
    return out + why + "\n";
  }
  return out + fmt::format(
                   "chosen: {} of {} blocks checkpointed; peak predicted {}, "
                   "measured {}; time predicted {:.1f} ms, measured {:.1f} ms\n",
                   chosen().size(), blocks.size(), format_bytes(predicted_peak),
                   format_bytes(measured_peak), predicted_ms, measured_ms);
}

CheckpointBudgetPlan plan_checkpoints(Trainer& trainer, CheckpointPolicy& policy,
                                      std::int64_t budget, const Batch& sample,
                                      const CheckpointBudgetOptions& options) {
  FRUGAL_CHECK(budget > 0, "frugal: the checkpoint budget must be > 0 bytes, got ", budget);
  FRUGAL_CHECK(options.trials() >= 1, "frugal: plan_checkpoints needs trials >= 1, got ",
               options.trials());
  FRUGAL_CHECK(options.margin() >= 0 && options.margin() < 1,
               "frugal: the checkpoint budget's margin must be in [0, 1), got ", options.margin());
  const auto& names = policy.wrapped();
  FRUGAL_CHECK(!names.empty(),
               "frugal: plan_checkpoints needs a CheckpointPolicy that chose "
               "blocks: add it to the trainer first");
  CheckpointBudgetPlan plan;
  plan.budget = budget;
  plan.margin = options.margin();
  policy.set_enabled(true);
  (void)trainer.trial(sample);  // warm-up: lazy initialisation is no part of the timings
  std::vector<std::vector<BlockCost>> trials;
  std::vector<double> step_ms;
  for (int t = 0; t < options.trials(); ++t) {
    Measurement measure(trainer.probe());
    const auto report = trainer.trial(sample);
    plan.all_checkpointed_peak = std::max(plan.all_checkpointed_peak, report.peak);
    step_ms.push_back(report.time.total_ms);
    trials.push_back(measure.blocks());
    plan.outside_peak = std::max(plan.outside_peak, measure.outside_peak());
  }
  plan.all_checkpointed_ms = median(step_ms);
  plan.blocks = combined(trials);
  for (const auto& name : names) {
    FRUGAL_CHECK(std::any_of(plan.blocks.begin(), plan.blocks.end(),
                             [&](const BlockCost& b) { return b.name == name; }),
                 "frugal: plan_checkpoints: the step did not run block '", name,
                 "' under a checkpoint (a block whose outputs need no gradient, or one the "
                 "forward did not reach)");
  }
  const auto limit =
      static_cast<std::int64_t>(static_cast<double>(budget) * (1 - options.margin()));
  plan.checkpointed = choose_checkpoints(plan.blocks, plan.outside_peak, limit);
  plan.fits = !plan.checkpointed.empty();
  if (!plan.fits) {
    plan.checkpointed.assign(plan.blocks.size(), true);
    plan.why = over_limit(plan.blocks, plan.outside_peak, limit);
    return plan;
  }
  plan.predicted_peak =
      predicted_checkpoint_peak(plan.blocks, plan.outside_peak, plan.checkpointed);
  plan.predicted_ms = plan.all_checkpointed_ms;
  for (std::size_t j = 0; j < plan.blocks.size(); ++j) {
    policy.set_enabled(plan.blocks[j].name, plan.checkpointed[j]);
    plan.predicted_ms -= plan.checkpointed[j] ? 0 : plan.blocks[j].forward_ms;
  }
  const auto report = trainer.trial(sample);
  plan.measured_peak = report.peak;
  plan.measured_ms = report.time.total_ms;
  return plan;
}

}  // namespace frugal
