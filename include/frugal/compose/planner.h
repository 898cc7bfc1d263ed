// Chooses micro-batch size, checkpointing and autocast so that a step fits a memory budget.
#pragma once

#include <torch/arg.h>
#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

#include "frugal/compose/checkpoint_budget.h"
#include "frugal/nn/int8_weights.h"
#include "frugal/optim/adam8bit.h"
#include "frugal/policy/autocast.h"
#include "frugal/policy/checkpoint_policy.h"
#include "frugal/policy/step_in_backward.h"
#include "frugal/train/trainer.h"

namespace frugal {

struct MemoryPlannerOptions {
  /// The predicted peak must stay below budget * (1 - margin).
  TORCH_ARG(double, margin) = 0.1;
  /// Blocks that may be checkpointed (all or none); no rule: checkpointing is not an option.
  TORCH_ARG(CheckpointSelect, checkpoint) = CheckpointSelect();
  /// A dtype autocast may use; unset: autocast is not an option.
  TORCH_ARG(c10::optional<torch::Dtype>, autocast) = c10::nullopt;
  /// The optimizer step in backward (StepInBackward) is an option; needs one of frugal's
  /// optimizers.
  TORCH_ARG(bool, step_in_backward) = false;
  /// 8-bit optimizer states are an option; needs one of frugal's 8-bit optimizers
  /// (frugal::optim::Adam8bit, AdamW8bit) with no state yet. They change the numerics a
  /// little, so they are chosen only when nothing fits with float32 states.
  TORCH_ARG(bool, quantized_states) = false;
  /// 8-bit states with factored second moments (QuantizedStateOptions::factored: a matrix's
  /// second moment as row and column statistics) are an option, after 8-bit ones: chosen
  /// only when nothing fits otherwise. Needs the same optimizers, with no state yet.
  TORCH_ARG(bool, factored_states) = false;
  /// 4-bit states (QuantizedStateOptions::bits 4) are an option, after 8-bit ones and before
  /// factored ones (which are then factored 4-bit states): chosen only when nothing fits
  /// otherwise. Needs the same optimizers, with no state yet, and an even block.
  TORCH_ARG(bool, four_bit_states) = false;
  /// Units whose matrices may be stored in 8 bits (nn::Int8Weights), picked as
  /// CheckpointSelect picks blocks: modules the model reaches through frugal::nn::call. The
  /// last resort: chosen only when nothing fits otherwise (after every state format and
  /// autocast). Their weights are materialised in their own dtype while they run; the codes
  /// round to the nearest when stored and stochastically when updated. No rule: not an
  /// option. Needs one of frugal's optimizers (they update the codes) with no state yet.
  TORCH_ARG(CheckpointSelect, int8_weights) = CheckpointSelect();
  /// The 8-bit weights' group and smallest matrix stored (their dtype is the units' own).
  TORCH_ARG(nn::Int8WeightsOptions, int8_options) = nn::Int8WeightsOptions();
  /// Plans whose predicted time is within this share of the fastest count as equally fast;
  /// among them a fixed order decides (fewest policies, then fewest micro-batches, then no
  /// checkpointing, then no step in backward), so timing noise on a busy machine does not
  /// change the choice between runs.
  TORCH_ARG(double, time_tolerance) = 0.25;
  /// Where the chosen plan checkpoints, choose which of the blocks (plan_checkpoints: each
  /// block measured, the least recompute time within the budget) instead of all of them.
  TORCH_ARG(bool, choose_blocks) = false;
};

/// One configuration the planner considered.
struct PlanOption {
  std::int64_t micro_batch = 0;
  std::int64_t micro_batches = 0;
  bool checkpoint = false;
  bool autocast = false;
  bool step_in_backward = false;
  /// The low-bit states the plan chooses (8-bit, 4-bit, factored); unset: the optimizer's
  /// own format (float32 where MemoryPlannerOptions::quantized_states lets it choose).
  c10::optional<optim::StateFormat> states;
  /// The units' matrices stored in 8 bits (MemoryPlannerOptions::int8_weights).
  bool int8_weights = false;
  std::int64_t predicted_peak = 0;  ///< bytes allocated at the step's peak
  double predicted_ms = 0;          ///< forward and backward of the whole batch
  bool fits = false;
  /// With MemoryPlannerOptions::choose_blocks, the chosen plan's blocks checkpointed, of
  /// how many (0 of 0: all of them).
  std::int64_t checkpointed_blocks = 0;
  std::int64_t blocks = 0;

  /// "micro-batch 32 (x8) + checkpoint + autocast + step in backward + 8-bit states"
  /// (or "+ 4-bit states", "+ factored 8-bit states", "+ factored 4-bit states"), then
  /// "+ 8-bit weights"
  std::string describe() const;
};

struct MemoryPlan {
  std::int64_t budget = 0;
  double margin = 0;
  std::int64_t optimizer_bytes = 0;  ///< optimizer state expected after the first step
  std::string optimizer;             ///< the optimizer, and whether it steps in place
  /// The ordinary optimizer step's peak: what lives between steps, all gradients, and the
  /// step's own temporaries (whole-parameter ones for LibTorch's, a chunk for frugal's).
  std::int64_t optimizer_step_peak = 0;
  /// The same two for each low-bit format the options add: 8-bit, 4-bit, then factored
  /// (4-bit where those are an option), in that order.
  struct StateCost {
    optim::StateFormat format;
    std::int64_t bytes = 0;      ///< optimizer state expected after the first step
    std::int64_t step_peak = 0;  ///< the ordinary optimizer step's peak
  };
  std::vector<StateCost> state_costs;
  /// The cost of the format of `bits` bits, factored or not, if the options add it.
  const StateCost* cost_of(int bits, bool factored = false) const;
  /// With MemoryPlannerOptions::int8_weights: what storing the units' matrices in 8 bits
  /// changes. A plan with them predicts its peak less (bytes - stored_bytes - unit_bytes):
  /// the matrices as codes, the largest unit whole while it runs; its ordinary optimizer
  /// step, which updates the codes, less (bytes - stored_bytes).
  struct WeightCost {
    std::int64_t units = 0;
    std::int64_t elements = 0;      ///< stored in 8 bits
    std::int64_t bytes = 0;         ///< those matrices' bytes as they are
    std::int64_t stored_bytes = 0;  ///< their codes and group statistics
    std::int64_t unit_bytes = 0;    ///< the largest unit's matrices whole
  };
  c10::optional<WeightCost> int8_cost;
  /// A chosen plan's 8-bit weights: the units' storage. The trainer keeps it while it
  /// lives; read the weights whole through an Int8Weights::Materialised of it.
  std::shared_ptr<nn::Int8Weights> int8_weights;
  std::vector<PlanOption> options;  ///< everything considered, measured or interpolated
  PlanOption chosen;
  std::int64_t measured_peak = 0;  ///< the chosen plan's peak, measured (with the state)
  /// With MemoryPlannerOptions::choose_blocks and a chosen plan that checkpoints: which of
  /// its blocks, how they were measured, and why (CheckpointBudgetPlan::table).
  CheckpointBudgetPlan block_choice;

  /// A markdown table of the options with the chosen one marked, and the measured peak.
  std::string table() const;
};

/// Measures the trainer's step on a sample batch under each candidate configuration and
/// chooses the cheapest whose predicted peak fits the budget, keeping the global batch.
///
/// Measured (with Trainer::trial, which leaves parameters and optimizer alone): the whole
/// batch, and micro-batches of a half and a quarter of it, each with and without
/// checkpointing, autocast and the step in backward where those are options. Smaller
/// micro-batches are predicted from the last two: activations grow linearly with the
/// micro-batch. Optimizer state not allocated yet is added from the optimizer's kind (SGD
/// with momentum: one buffer per parameter; Adam and AdamW: two, three with amsgrad;
/// Adagrad and RMSprop: as their options say). The ordinary optimizer step peaks at what
/// lives between steps plus all gradients plus its temporaries: LibTorch's Adam makes two
/// the size of the largest parameter (three with weight decay), its SGD one with weight
/// decay and one more with Nesterov; frugal's optimizers (frugal::optim) a chunk
/// (InPlaceOptimizer::scratch_bytes). Under the step in backward there is no such peak:
/// the trial measures gradients freed as they are used.
///
/// Plan with the worst-case batch (the longest sequences, the largest images the run will
/// see): the plan holds for the sample it measured, and a larger real batch may peak above
/// the budget. Keep OomRecovery as the backstop for what the sample did not foresee.
///
/// With frugal's 8-bit optimizers (Adam8bit, AdamW8bit) the state to come is counted from
/// their format, and with MemoryPlannerOptions::quantized_states each configuration is also
/// predicted with 8-bit states (the trials do not depend on the states' format), with
/// MemoryPlannerOptions::four_bit_states with 4-bit ones, and with
/// MemoryPlannerOptions::factored_states with factored ones (4-bit where those are an option).
/// The planner changes the states' format, never the weights' dtype. With
/// MemoryPlannerOptions::int8_weights it may store the chosen units' matrices in 8 bits,
/// last of all: predicted from the same trials (the matrices as codes and statistics, the
/// largest unit whole while it runs; the predicted time leaves out the coding), then
/// applied (the first trial checked that each unit is reached through frugal::nn::call) and
/// measured. The codes stay after plan() returns (they round the weights to 8 bits).
///
/// Cheapest: the least predicted time; plans within MemoryPlannerOptions::time_tolerance (25%)
/// of it count as equal and a fixed order decides among them (the fewest policies wins). 8-bit
/// states and autocast change the numerics, so they are chosen only when nothing fits without them:
/// float32 states first, then 8-bit states, then 4-bit ones, then factored ones, then autocast
/// with each of them in the same order. The chosen plan is applied to
/// the trainer (its micro-batch and the planner's policies, added to the trainer once) and
/// measured. With MemoryPlannerOptions::choose_blocks, a chosen plan that checkpoints then
/// checkpoints only the blocks plan_checkpoints chooses within the budget (less the
/// optimizer state to come).
///
/// Example:
///   frugal::MemoryPlanner planner(trainer, frugal::MemoryPlannerOptions().checkpoint(
///       frugal::CheckpointSelect().types({"ResidualBlock"})));
///   auto plan = planner.plan(frugal::MiB(512), worst_case_batch);
///   fmt::print("{}\n", plan.table());
class MemoryPlanner {
 public:
  explicit MemoryPlanner(Trainer& trainer, MemoryPlannerOptions options = {});
  MemoryPlan plan(std::int64_t budget, const Batch& sample);

 private:
  // plan() in its three parts: what each states' format costs, the trials, the prediction of
  // every configuration from them, and the choice (applied to the trainer and measured).
  struct Trials;
  MemoryPlan price_states(std::int64_t budget);
  Trials measure(const Batch& sample);
  void predict(MemoryPlan& plan, const Trials& trials) const;
  void choose(MemoryPlan& plan, const Batch& sample);
  // A format of the optimizer's states to configure: unset, as the optimizer was made.
  using Format = c10::optional<optim::StateFormat>;
  void configure(std::int64_t micro_batch, bool checkpoint, bool autocast, bool in_backward,
                 const Format& format);
  void set_state_format(const Format& format);
  bool chooses_states() const;  ///< whether any low-bit format is an option
  /// `bits` codes, factored or not, rounded as the optimizer rounds its own width.
  optim::StateFormat low_bit(int bits, bool factored) const;
  std::int64_t pending_optimizer_bytes(const Format& format);
  std::int64_t optimizer_step_peak(std::int64_t pending_state, std::string* description);

  Trainer& trainer_;
  MemoryPlannerOptions options_;
  std::shared_ptr<CheckpointPolicy> checkpoint_;
  std::shared_ptr<AutocastPolicy> autocast_;
  std::shared_ptr<StepInBackward> in_backward_;
  // The units that may be stored in 8 bits, each with the dtype its matrices run in
  // (planner_int8.cpp).
  void select_int8_units();
  void price_weights(MemoryPlan& plan) const;
  void check_units_reached(const Batch& sample);
  void store_weights(MemoryPlan& plan);
  void keep_int8_weights(const MemoryPlan& plan);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> int8_units_;
  c10::optional<torch::Dtype> int8_dtype_;
  bool int8_stored_ = false;  ///< a plan stored them: later plans measure them so
  optim::QuantizedStateOptimizer* quantized_ = nullptr;  ///< the trainer's, if 8-bit
  Format base_format_;  ///< float32 where the planner chooses 8-bit; else as made
  optim::StateFormat format_at_start_;
};

}  // namespace frugal
