// How the planner describes its plans and picks one of those it measured.
#include "choose_plan.h"

#include <fmt/format.h>

#include <string>
#include <tuple>

#include "frugal/memory/format.h"

namespace frugal {
namespace {

// How far a plan's states are from float32, in the order numerics are kept longest: the
// optimizer's own, 8-bit, 4-bit, factored 8-bit, factored 4-bit.
int states_rank(const PlanOption& o) {
  if (!o.states) {
    return 0;
  }
  return (o.states->factored ? 3 : 1) + (o.states->bits == 4 ? 1 : 0);
}

int policies_in(const PlanOption& o) {
  return (o.checkpoint ? 1 : 0) + (o.autocast ? 1 : 0) + (o.micro_batches > 1 ? 1 : 0) +
         (o.step_in_backward ? 1 : 0) + (o.states ? 1 : 0) + (o.int8_weights ? 1 : 0);
}

bool same_plan(const PlanOption& a, const PlanOption& b) {
  return a.micro_batch == b.micro_batch && a.checkpoint == b.checkpoint &&
         a.autocast == b.autocast && a.step_in_backward == b.step_in_backward &&
         a.states == b.states && a.int8_weights == b.int8_weights;
}

// "8-bit states", "factored 4-bit states", ...
std::string states_name(const optim::StateFormat& f) {
  return fmt::format("{}{}-bit states", f.factored ? "factored " : "", f.bits);
}

}  // namespace

std::string PlanOption::describe() const {
  std::string out = micro_batches > 1
                        ? fmt::format("micro-batch {} (x{})", micro_batch, micro_batches)
                        : std::string("whole batch");
  if (checkpoint) {
    out += blocks > 0 ? fmt::format(" + checkpoint ({} of {} blocks)", checkpointed_blocks, blocks)
                      : std::string(" + checkpoint");
  }
  if (autocast) {
    out += " + autocast";
  }
  if (step_in_backward) {
    out += " + step in backward";
  }
  if (states) {
    out += " + " + states_name(*states);
  }
  if (int8_weights) {
    out += " + 8-bit weights";
  }
  return out;
}

const MemoryPlan::StateCost* MemoryPlan::cost_of(int bits, bool factored) const {
  for (const auto& cost : state_costs) {
    if (cost.format.bits == bits && cost.format.factored == factored) {
      return &cost;
    }
  }
  return nullptr;
}

std::string MemoryPlan::table() const {
  std::string out = fmt::format(
      "Budget {} (plans must predict under {} with a {:.0f}% margin); optimizer state to "
      "come: {}; {}: its step peaks at {}",
      format_bytes(budget), format_bytes(static_cast<std::int64_t>(budget * (1 - margin))),
      margin * 100, format_bytes(optimizer_bytes), optimizer, format_bytes(optimizer_step_peak));
  for (const auto& cost : state_costs) {
    out += fmt::format("; with {}: {}, step peak {}", states_name(cost.format),
                       format_bytes(cost.bytes), format_bytes(cost.step_peak));
  }
  if (int8_cost) {
    out += fmt::format(
        "; with 8-bit weights: {} of matrices in {} units as {}, the largest unit whole {}",
        format_bytes(int8_cost->bytes), int8_cost->units, format_bytes(int8_cost->stored_bytes),
        format_bytes(int8_cost->unit_bytes));
  }
  out += "\n\n| plan | predicted peak | predicted time (ms) | fits |\n|---|---|---|---|\n";
  for (const auto& o : options) {
    const bool is_chosen = same_plan(o, chosen);
    out += fmt::format("| {}{}{} | {} | {:.1f} | {} |\n", is_chosen ? "**" : "", o.describe(),
                       is_chosen ? "** (chosen)" : "", format_bytes(o.predicted_peak),
                       o.predicted_ms, o.fits ? "yes" : "no");
  }
  out += fmt::format("\nChosen: {}; predicted peak {}, measured {}\n", chosen.describe(),
                     format_bytes(chosen.predicted_peak), format_bytes(measured_peak));
  if (!block_choice.blocks.empty()) {
    out += "\nWhich blocks to checkpoint:\n\n" + block_choice.table();
  }
  return out;
}

namespace detail {

const PlanOption* choose_plan(const std::vector<PlanOption>& options, double time_tolerance) {
  // The fixed order among plans that are equally fast: the simplest first.
  auto key = [](const PlanOption& o) {
    return std::make_tuple(policies_in(o), o.micro_batches, o.checkpoint, o.step_in_backward);
  };
  // Numerics kept longest: float32 states, then 8-bit states, 4-bit ones, factored ones
  // (8-bit, or 4-bit where those are an option), then the same with autocast; then all of
  // these again with 8-bit weights.
  for (const bool int8_weights : {false, true}) {
    for (const bool autocast : {false, true}) {
      for (int rank = 0; rank <= 4; ++rank) {
        const auto candidate = [&](const PlanOption& o) {
          return o.fits && o.int8_weights == int8_weights && o.autocast == autocast &&
                 states_rank(o) == rank;
        };
        double fastest = -1;
        for (const auto& o : options) {
          if (candidate(o) && (fastest < 0 || o.predicted_ms < fastest)) {
            fastest = o.predicted_ms;
          }
        }
        const PlanOption* best = nullptr;
        for (const auto& o : options) {
          if (candidate(o) && o.predicted_ms <= fastest * (1 + time_tolerance) &&
              (best == nullptr || key(o) < key(*best))) {
            best = &o;
          }
        }
        if (best != nullptr) {
          return best;
        }
      }
    }
  }
  return nullptr;
}

}  // namespace detail
}  // namespace frugal
