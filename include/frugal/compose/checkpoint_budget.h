// Chooses which blocks to checkpoint so that a step fits a memory budget, at the least
// recompute time: each block of a chain measured once, then a dynamic program.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

#include "frugal/policy/checkpoint_policy.h"
#include "frugal/train/batch.h"
#include "frugal/train/trainer.h"

namespace frugal {

/// One checkpointed block as a step with every chosen block checkpointed measured it. Bytes
/// are the probe's (exact on the CPU), times the clock's: over the micro-batches of a step
/// times add up and bytes take their highest; over the measured steps times take their
/// median and bytes their highest.
struct BlockCost {
  std::string name;               ///< the block's qualified name
  std::int64_t output_bytes = 0;  ///< its outputs
  /// What running it plainly keeps from its forward until its backward, besides its outputs:
  /// the activations its recompute kept.
  std::int64_t kept_bytes = 0;
  std::int64_t backward_base = 0;  ///< bytes allocated as its backward began
  /// The highest bytes of its recompute and backward, above backward_base.
  std::int64_t checkpointed_peak = 0;
  /// The highest bytes of its backward alone with its activations kept, above backward_base.
  std::int64_t plain_peak = 0;
  double forward_ms = 0;    ///< its forward without gradients: what checkpointing adds
  double recompute_ms = 0;  ///< its forward with gradients, in backward
  double backward_ms = 0;
};

struct CheckpointBudgetOptions {
  /// The predicted peak must stay below budget * (1 - margin).
  TORCH_ARG(double, margin) = 0.0;
  /// Measured steps: each block's times are their median, its bytes their highest.
  TORCH_ARG(int, trials) = 3;
};

/// What plan_checkpoints measured, predicted and chose.
struct CheckpointBudgetPlan {
  std::int64_t budget = 0;
  double margin = 0;
  std::vector<BlockCost> blocks;   ///< in the order the forward runs them
  std::vector<bool> checkpointed;  ///< the choice, one per block
  /// The highest bytes of the step outside the blocks' backward (the forward, the loss, the
  /// head's backward), every block checkpointed.
  std::int64_t outside_peak = 0;
  bool fits = false;
  std::string why;                         ///< why no choice fits, when none does
  std::int64_t all_checkpointed_peak = 0;  ///< measured: the step's peak, every block checkpointed
  double all_checkpointed_ms = 0;          ///< measured: the step's time, the same
  std::int64_t predicted_peak = 0;         ///< the choice's
  double predicted_ms = 0;                 ///< the choice's: less each plain block's forward
  std::int64_t measured_peak = 0;          ///< the choice's step, run once (0: none fits)
  double measured_ms = 0;

  /// The names of the blocks chosen for checkpointing.
  std::vector<std::string> chosen() const;
  /// A markdown table of the blocks (bytes, times, the choice), then the predicted and
  /// measured peaks and times.
  std::string table() const;
};

/// The peak a step would reach with `checkpointed[j]` choosing for blocks[j] (the model
/// plan_checkpoints optimizes): the backward of block j starts at its measured base plus
/// the kept bytes of the plain blocks before it, and reaches its checkpointed or plain
/// peak above that; outside the blocks' backward the step reaches outside_peak plus the
/// kept bytes of every plain block.
std::int64_t predicted_checkpoint_peak(const std::vector<BlockCost>& blocks,
                                       std::int64_t outside_peak,
                                       const std::vector<bool>& checkpointed);

/// The choice of least added forward time whose predicted peak is at most `limit`, by
/// dynamic programming over the blocks with the plain blocks' kept bytes as the state (in
/// `limit / buckets` steps, rounded up, so the choice never exceeds the limit). Empty when
/// none fits, even with every block checkpointed.
std::vector<bool> choose_checkpoints(const std::vector<BlockCost>& blocks,
                                     std::int64_t outside_peak, std::int64_t limit,
                                     std::int64_t buckets = 4096);

/// Measures the trainer's step on `sample` with every block `policy` chose checkpointed
/// (Trainer::trial, which leaves parameters and optimizer alone), chooses per block
/// whether to checkpoint it (rotor's persistent-or-recompute choice over a chain) so that
/// the predicted peak of the step's forward and backward stays within the budget at the
/// least recompute time, applies the choice to `policy` and measures it once. When nothing
/// fits, every block stays checkpointed and `why` says which part of the step is over.
/// `policy` must be one of the trainer's policies; each of its blocks runs once a forward.
/// The optimizer step's own peak is not part of the budget here (MemoryPlanner adds it).
///
/// Example:
///   auto blocks = std::make_shared<frugal::CheckpointPolicy>(
///       frugal::CheckpointSelect().types({"Block"}));
///   trainer.add_policy(blocks);
///   auto plan = frugal::plan_checkpoints(trainer, *blocks, frugal::MiB(300), sample_batch);
///   std::puts(plan.table().c_str());
CheckpointBudgetPlan plan_checkpoints(Trainer& trainer, CheckpointPolicy& policy,
                                      std::int64_t budget, const Batch& sample,
                                      const CheckpointBudgetOptions& options = {});

}  // namespace frugal
