#include "frugal/compose/planner.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/optim.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "choose_plan.h"
#include "frugal/error.h"
#include "frugal/memory/format.h"

namespace frugal {
namespace {

bool chooses_something(const CheckpointSelect& s) {
  return !s.names().empty() || !s.types().empty() || s.every() > 0;
}

// Buffers per parameter that the optimizer allocates at its first step.
double state_buffers(const torch::optim::OptimizerOptions& o) {
  using namespace torch::optim;
  if (auto* sgd = dynamic_cast<const SGDOptions*>(&o)) {
    return sgd->momentum() > 0 ? 1 : 0;
  }
  if (auto* adam = dynamic_cast<const AdamOptions*>(&o)) {
    return adam->amsgrad() ? 3 : 2;
  }
  if (auto* adamw = dynamic_cast<const AdamWOptions*>(&o)) {
    return adamw->amsgrad() ? 3 : 2;
  }
  if (dynamic_cast<const AdagradOptions*>(&o) != nullptr) {
    return 1;
  }
  if (auto* rms = dynamic_cast<const RMSpropOptions*>(&o)) {
    return 1 + (rms->momentum() > 0 ? 1 : 0) + (rms->centered() ? 1 : 0);
  }
  return 2;  // unknown: as much as Adam
}

// Whole-parameter temporaries LibTorch's optimizer step allocates at once, in units of
// the largest parameter.
int step_temporaries(const torch::optim::OptimizerOptions& o) {
  using namespace torch::optim;
  if (auto* sgd = dynamic_cast<const SGDOptions*>(&o)) {
    return (sgd->weight_decay() != 0 ? 1 : 0) + (sgd->momentum() != 0 && sgd->nesterov() ? 1 : 0);
  }
  if (auto* adam = dynamic_cast<const AdamOptions*>(&o)) {
    return adam->weight_decay() != 0 ? 3 : 2;
  }
  return 2;  // AdamW's denominator, and as much for the others
}

}  // namespace

MemoryPlanner::MemoryPlanner(Trainer& trainer, MemoryPlannerOptions options)
    : trainer_(trainer), options_(std::move(options)) {
  FRUGAL_CHECK(options_.time_tolerance() >= 0,
               "frugal: the planner's time_tolerance must be "
               ">= 0, got ",
               options_.time_tolerance());
  FRUGAL_CHECK(options_.margin() >= 0 && options_.margin() < 1,
               "frugal: the planner's margin must be in [0, 1), got ", options_.margin());
  if (chooses_something(options_.checkpoint())) {
    checkpoint_ = std::make_shared<CheckpointPolicy>(options_.checkpoint());
    FRUGAL_CHECK(!checkpoint_->apply(trainer_.module()).empty(),
                 "frugal: the planner's checkpoint rule matches no block of the model");
    checkpoint_->set_enabled(false);
    trainer_.add_policy(checkpoint_);
  }
  if (options_.autocast()) {
    autocast_ =
        std::make_shared<AutocastPolicy>(trainer_.options().device().type(), *options_.autocast());
    autocast_->set_enabled(false);
    trainer_.add_policy(autocast_);
  }
  if (options_.step_in_backward()) {
    in_backward_ = std::make_shared<StepInBackward>();
    in_backward_->set_enabled(false);
    trainer_.add_policy(in_backward_);  // refuses an optimizer that is not frugal's
  }
  quantized_ = dynamic_cast<optim::QuantizedStateOptimizer*>(&trainer_.optimizer());
  if (quantized_ != nullptr) {
    format_at_start_ = quantized_->state_format();
  }
  for (const auto& [on, name] : {std::pair{options_.quantized_states(), "quantized_states"},
                                 std::pair{options_.factored_states(), "factored_states"},
                                 std::pair{options_.four_bit_states(), "four_bit_states"}}) {
    if (!on) {
      continue;
    }
    FRUGAL_CHECK(quantized_ != nullptr, "frugal: MemoryPlannerOptions::", name,
                 " needs one of frugal's low-bit optimizers (frugal::optim::Adam8bit, AdamW8bit, "
                 "Adam4bit, AdamW4bit)");
    FRUGAL_CHECK(trainer_.optimizer().state().empty(), "frugal: MemoryPlannerOptions::", name,
                 " needs an optimizer without state: the states' format is chosen before the "
                 "first step");
  }
  if (options_.quantized_states()) {
    base_format_ = optim::StateFormat();  // float32 states first
  }
  if (chooses_something(options_.int8_weights())) {
    select_int8_units();
  }
  if (options_.four_bit_states()) {
    (void)quantized_->pending_state_bytes(low_bit(4, false));  // refuses an odd block, naming it
  }
}

optim::StateFormat MemoryPlanner::low_bit(int bits, bool factored) const {
  // Codes of another width than the optimizer's round as that width's optimizers do:
  // stochastically at 4 bits (four_bit_states()), to the nearest at 8.
  const bool own_width = format_at_start_.bits == bits;
  return {bits, factored, own_width ? format_at_start_.stochastic : bits == 4};
}

bool MemoryPlanner::chooses_states() const {
  return options_.quantized_states() || options_.factored_states() || options_.four_bit_states();
}

void MemoryPlanner::set_state_format(const Format& format) {
  if (chooses_states()) {  // else the optimizer's, as made
    quantized_->set_state_format(format.value_or(format_at_start_));
  }
}

void MemoryPlanner::configure(std::int64_t micro_batch, bool checkpoint, bool autocast,
                              bool in_backward, const Format& format) {
  trainer_.set_micro_batch(micro_batch);
  set_state_format(format);
  if (checkpoint_) {
    checkpoint_->set_enabled(checkpoint);
  }
  if (autocast_) {
    autocast_->set_enabled(autocast);
  }
  if (in_backward_) {
    in_backward_->set_enabled(in_backward);
  }
}

std::int64_t MemoryPlanner::optimizer_step_peak(std::int64_t pending_state,
                                                std::string* description) {
  auto& optimizer = trainer_.optimizer();
  std::int64_t grads = 0, grads_alive = 0, largest = 0;
  int temporaries = 0;
  for (auto& group : optimizer.param_groups()) {
    temporaries = std::max(temporaries, step_temporaries(group.options()));
    for (const auto& p : group.params()) {
      const auto bytes = p.numel() * static_cast<std::int64_t>(p.element_size());
      grads += p.requires_grad() ? bytes : 0;
      grads_alive += p.grad().defined() ? bytes : 0;
      largest = std::max(largest, bytes);
    }
  }
  std::int64_t scratch = temporaries * largest;
  if (auto* in_place = dynamic_cast<optim::InPlaceOptimizer*>(&optimizer)) {
    scratch = in_place->scratch_bytes();
    *description = fmt::format("frugal's in-place optimizer (scratch {})", format_bytes(scratch));
  } else {
    *description = temporaries == 0
                       ? std::string("LibTorch's optimizer (no temporaries)")
                       : fmt::format(
                             "LibTorch's optimizer ({} temporaries the size of the largest "
                             "parameter, {}; frugal::optim's step needs a chunk)",
                             temporaries, format_bytes(temporaries * largest));
  }
  return trainer_.probe().allocated() - grads_alive + pending_state + grads + scratch;
}

std::int64_t MemoryPlanner::pending_optimizer_bytes(const Format& format) {
  auto& optimizer = trainer_.optimizer();
  if (!optimizer.state().empty()) {
    return 0;  // allocated already, and part of what the trials start from
  }
  if (quantized_ != nullptr) {
    return quantized_->pending_state_bytes(format.value_or(format_at_start_));
  }
  double bytes = 0;
  for (auto& group : optimizer.param_groups()) {
    const double buffers = state_buffers(group.options());
    for (const auto& p : group.params()) {
      bytes += buffers * static_cast<double>(p.numel() * p.element_size());
    }
  }
  return static_cast<std::int64_t>(bytes);
}

// What the trials measured: each configuration's (peak, ms) at the whole batch, a half and a
// quarter of it, and the micro-batch sizes a plan may take.
struct MemoryPlanner::Trials {
  struct Config {
    bool in_backward, checkpoint, autocast;
  };
  std::int64_t batch = 0, half = 0, quarter = 0;
  std::vector<std::int64_t> sizes;  // the batch, halved down to 1
  std::vector<std::pair<Config, std::map<std::int64_t, std::pair<double, double>>>> measured;
};

namespace {

// A plan's optimizer state to come and its ordinary step's peak: its low-bit format's, or
// the optimizer's own (null).
const MemoryPlan::StateCost* cost_of(const MemoryPlan& plan, const PlanOption& o) {
  return o.states ? plan.cost_of(o.states->bits, o.states->factored) : nullptr;
}
std::int64_t state_bytes(const MemoryPlan& plan, const PlanOption& o) {
  const auto* cost = cost_of(plan, o);
  return cost != nullptr ? cost->bytes : plan.optimizer_bytes;
}
std::int64_t step_peak(const MemoryPlan& plan, const PlanOption& o) {
  const auto* cost = cost_of(plan, o);
  return cost != nullptr ? cost->step_peak : plan.optimizer_step_peak;
}

}  // namespace

MemoryPlan MemoryPlanner::plan(std::int64_t budget, const Batch& sample) {
  FRUGAL_CHECK(budget > 0, "frugal: the memory budget must be > 0 bytes, got ", budget);
  FRUGAL_CHECK(sample.size() > 0, "frugal: the planner's sample batch is empty");
  // A plan that fails (no plan fits, a trial's error) leaves the trainer as it was: its
  // micro-batch, each policy's switch, each block's checkpointing, the states' format.
  const auto counters = trainer_.counters();
  const bool autocast = autocast_ && autocast_->enabled();
  const bool in_backward = in_backward_ && in_backward_->enabled();
  std::vector<std::pair<std::string, bool>> blocks;
  if (checkpoint_) {
    for (const auto& block : checkpoint_->wrapped()) {
      blocks.emplace_back(block, checkpoint_->enabled(block));
    }
  }
  const auto format =
      quantized_ ? c10::optional<optim::StateFormat>(quantized_->state_format()) : c10::nullopt;
  try {
    auto plan = price_states(budget);
    const auto trials = measure(sample);
    predict(plan, trials);
    choose(plan, sample);
    return plan;
  } catch (...) {
    trainer_.restore_counters(counters);
    if (autocast_) {
      autocast_->set_enabled(autocast);
    }
    if (in_backward_) {
      in_backward_->set_enabled(in_backward);
    }
    for (const auto& [block, on] : blocks) {
      checkpoint_->set_enabled(block, on);
    }
    if (format) {
      quantized_->set_state_format(*format);
    }
    throw;
  }
}

MemoryPlan MemoryPlanner::price_states(std::int64_t budget) {
  MemoryPlan plan;
  plan.budget = budget;
  plan.margin = options_.margin();
  plan.optimizer_bytes = pending_optimizer_bytes(base_format_);
  plan.optimizer_step_peak = optimizer_step_peak(plan.optimizer_bytes, &plan.optimizer);
  // The low-bit formats the options add, each with its state to come and step peak.
  const int smallest_bits = options_.four_bit_states() ? 4 : 8;
  for (const auto& [on, format] :
       {std::pair{options_.quantized_states(), low_bit(8, false)},
        std::pair{options_.four_bit_states(), low_bit(4, false)},
        std::pair{options_.factored_states(), low_bit(smallest_bits, true)}}) {
    if (on) {
      std::string ignored;
      MemoryPlan::StateCost cost{format, pending_optimizer_bytes(format), 0};
      cost.step_peak = optimizer_step_peak(cost.bytes, &ignored);
      plan.state_costs.push_back(cost);
    }
  }
  price_weights(plan);
  return plan;
}

MemoryPlanner::Trials MemoryPlanner::measure(const Batch& sample) {
  Trials t;
  t.batch = sample.size();
  for (std::int64_t m = t.batch; m >= 1; m /= 2) {
    t.sizes.push_back(m);
  }
  t.half = t.sizes.size() > 1 ? t.sizes[1] : t.batch;
  t.quarter = t.sizes.size() > 2 ? t.sizes[2] : t.half;
  configure(t.batch, false, false, false, c10::nullopt);
  // Warm-up: lazy initialisation is no part of the timings. It also checks that the step
  // reaches each unit that may be stored in 8 bits.
  if (!int8_units_.empty() && !int8_stored_) {
    check_units_reached(sample);
  } else {
    (void)trainer_.trial(sample);
  }
  for (const bool in_backward : {false, true}) {
    for (const bool checkpoint : {false, true}) {
      for (const bool autocast : {false, true}) {
        if ((checkpoint && !checkpoint_) || (autocast && !autocast_) ||
            (in_backward && !in_backward_)) {
          continue;
        }
        std::map<std::int64_t, std::pair<double, double>> measured;  // size -> (peak, ms)
        for (const auto m : {t.batch, t.half, t.quarter}) {
          if (measured.count(m) == 0) {
            configure(m, checkpoint, autocast, in_backward, c10::nullopt);
            const auto r = trainer_.trial(sample);
            measured[m] = {static_cast<double>(r.peak), r.time.total_ms};
          }
        }
        t.measured.push_back({{in_backward, checkpoint, autocast}, std::move(measured)});
      }
    }
  }
  return t;
}

void MemoryPlanner::predict(MemoryPlan& plan, const Trials& t) const {
  const double limit = static_cast<double>(plan.budget) * (1 - plan.margin);
  std::vector<c10::optional<optim::StateFormat>> formats{c10::nullopt};
  for (const auto& cost : plan.state_costs) {
    formats.emplace_back(cost.format);
  }
  std::map<std::tuple<std::int64_t, bool, bool>, double> times;  // for the monotone rule
  for (const auto& [config, measured] : t.measured) {
    const auto [in_backward, checkpoint, autocast] = config;
    for (const auto m : t.sizes) {
      double peak, ms;
      if (measured.count(m) != 0 || t.half == t.quarter) {
        std::tie(peak, ms) = measured.count(m) ? measured.at(m) : measured.at(t.quarter);
      } else {
        // Several micro-batches: activations linear in the micro-batch, time linear in the
        // number of micro-batches (and never falling with it).
        const auto [p2, t2] = measured.at(t.half);
        const auto [p4, t4] = measured.at(t.quarter);
        peak = p4 + (p2 - p4) * static_cast<double>(m - t.quarter) /
                        static_cast<double>(t.half - t.quarter);
        const double n2 = static_cast<double>((t.batch + t.half - 1) / t.half);
        const double n4 = static_cast<double>((t.batch + t.quarter - 1) / t.quarter);
        const double per_micro = std::max(0.0, (t4 - t2) / (n4 - n2));
        ms = t4 + per_micro * (static_cast<double>((t.batch + m - 1) / m) - n4);
      }
      // A policy never makes a step faster: a measured gain is noise.
      if (m != t.batch) {
        ms = std::max(ms, times[{t.batch, checkpoint, autocast}]);
      }
      if (checkpoint) {
        ms = std::max(ms, times[{m, false, autocast}]);
      }
      times[{m, checkpoint, autocast}] = std::max(times[{m, checkpoint, autocast}], ms);
      for (const auto& states : formats) {
        PlanOption o;
        o.states = states;
        o.micro_batch = m;
        o.micro_batches = (t.batch + m - 1) / m;
        o.checkpoint = checkpoint;
        o.autocast = autocast;
        o.step_in_backward = in_backward;
        o.predicted_peak = std::max(static_cast<std::int64_t>(peak) + state_bytes(plan, o),
                                    in_backward ? 0 : step_peak(plan, o));
        o.predicted_ms = ms;
        o.fits = static_cast<double>(o.predicted_peak) <= limit;
        plan.options.push_back(o);
        if (plan.int8_cost) {  // the matrices as codes, the largest unit whole
          const auto& c = *plan.int8_cost;
          o.int8_weights = true;
          o.predicted_peak =
              std::max(static_cast<std::int64_t>(peak) + state_bytes(plan, o) - c.bytes +
                           c.stored_bytes + c.unit_bytes,
                       in_backward ? 0 : step_peak(plan, o) - c.bytes + c.stored_bytes);
          o.fits = static_cast<double>(o.predicted_peak) <= limit;
          plan.options.push_back(o);
        }
      }
    }
  }
}

void MemoryPlanner::choose(MemoryPlan& plan, const Batch& sample) {
  const double limit = static_cast<double>(plan.budget) * (1 - plan.margin);
  const PlanOption* best = detail::choose_plan(plan.options, options_.time_tolerance());
  if (best == nullptr) {
    const auto smallest = std::min_element(
        plan.options.begin(), plan.options.end(),
        [](const auto& a, const auto& b) { return a.predicted_peak < b.predicted_peak; });
    FRUGAL_CHECK(false, "frugal: no plan fits the budget of ", format_bytes(plan.budget), " (",
                 format_bytes(static_cast<std::int64_t>(limit)),
                 " with the margin); the smallest predicted peak is ",
                 format_bytes(smallest->predicted_peak), " with ", smallest->describe());
  }
  plan.chosen = *best;
  configure(best->micro_batch, best->checkpoint, best->autocast, best->step_in_backward,
            best->states ? Format(best->states) : base_format_);
  const auto state = state_bytes(plan, *best);
  if (best->int8_weights) {
    store_weights(plan);
  }
  if (best->checkpoint && options_.choose_blocks() && limit > static_cast<double>(state)) {
    // The trials do not hold the optimizer state to come: the blocks' budget leaves it room.
    plan.block_choice =
        plan_checkpoints(trainer_, *checkpoint_, static_cast<std::int64_t>(limit) - state, sample);
    if (plan.block_choice.fits) {
      plan.chosen.checkpointed_blocks =
          static_cast<std::int64_t>(plan.block_choice.chosen().size());
      plan.chosen.blocks = static_cast<std::int64_t>(plan.block_choice.blocks.size());
      plan.chosen.predicted_peak = std::max(plan.block_choice.predicted_peak + state,
                                            best->step_in_backward ? 0 : step_peak(plan, *best));
      plan.chosen.predicted_ms *=
          plan.block_choice.predicted_ms / std::max(1e-9, plan.block_choice.all_checkpointed_ms);
    }
  }
  plan.measured_peak = trainer_.trial(sample).peak + state;
  if (plan.int8_weights) {  // measured: the trainer keeps them
    keep_int8_weights(plan);
  }
}

}  // namespace frugal
