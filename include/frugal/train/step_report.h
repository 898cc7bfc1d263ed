// What one training step or one evaluation did, in numbers only.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "frugal/memory/ledger.h"
#include "frugal/memory/probe.h"

namespace frugal {

/// Wall time of a step and of its phases, in milliseconds. On CUDA the trainer waits for
/// the device at the end of the forward, backward and optimizer phases and of the step, so
/// that each phase counts its kernels, not their launches (the planner's times rest on
/// them); host-to-device copies are queued without waiting and count in the forward. The
/// phases follow one another, each from where the one before ended (one clock read between
/// two), so that they add up to the step's time less its start and end.
struct PhaseTimes {
  double data_ms = 0;       ///< splitting the batch and queuing micro-batches to the device
  double forward_ms = 0;    ///< forward passes and loss, all micro-batches
  double backward_ms = 0;   ///< backward passes, all micro-batches
  double optimizer_ms = 0;  ///< unscale/clip, optimizer step and zeroing
  double total_ms = 0;
};

/// One call of Trainer::step. Loss is a number: nothing here keeps a graph alive.
struct StepReport {
  std::int64_t step = 0;           ///< optimizer steps taken so far
  std::int64_t batch = 0;          ///< batches seen so far (calls of step)
  bool stepped = false;            ///< the optimizer step ran (or was skipped) at this call
  double loss = 0;                 ///< mean loss of the batch (by its global count)
  std::int64_t samples = 0;        ///< samples in the batch
  std::int64_t count = 0;          ///< the batch's global count (samples, or e.g. tokens)
  std::int64_t micro_batch = 0;    ///< micro-batch size in use
  std::int64_t micro_batches = 0;  ///< micro-batches this batch ran as
  double lr = 0;                   ///< learning rate of the first parameter group
  double scale = 1;                ///< loss scale in use (1 without a GradScaler)
  bool skipped = false;            ///< the optimizer step was skipped (inf/NaN gradients)
  /// The step was skipped because the loss or a gradient was not finite (no GradScaler:
  /// the engine's own guard, TrainerOptions::skip_non_finite).
  bool non_finite = false;
  std::int64_t skipped_total = 0;  ///< optimizer steps skipped so far
  std::int64_t oom_retries = 0;    ///< out-of-memory retries within this step
  PhaseTimes time;
  MemorySnapshot memory;           ///< after the step (after zeroing)
  std::int64_t peak = 0;           ///< peak allocated bytes during the step
  std::int64_t forward_peak = 0;   ///< highest peak of a forward pass
  std::int64_t backward_peak = 0;  ///< highest peak of a backward pass
  Ledger ledger;                   ///< where `memory.allocated` went
  /// What TrainerOptions::metrics counted, summed over the batch's micro-batches.
  std::map<std::string, double> metrics;

  std::string summary() const;
  std::string to_json() const;
};

/// One call of Trainer::evaluate.
struct EvalReport {
  std::int64_t step = 0;  ///< optimizer steps taken before it
  double loss = 0;        ///< mean loss over the samples
  /// Share of argmax hits among the scored targets (class targets, per sample or per
  /// position, those equal to TrainerOptions::ignore_index left out); -1 when n/a.
  double accuracy = -1;
  std::int64_t scored = 0;  ///< targets the accuracy counts
  std::int64_t samples = 0;
  std::int64_t count = 0;       ///< what the loss is averaged over (samples, or the count's)
  std::int64_t batch_size = 0;  ///< evaluation batch size at the end
  std::int64_t batches = 0;
  std::int64_t oom_retries = 0;  ///< chunks retried with a smaller batch
  double time_ms = 0;
  MemorySnapshot memory;  ///< after evaluation
  std::int64_t peak = 0;  ///< peak allocated bytes during evaluation
  Ledger ledger;

  std::string summary() const;
  std::string to_json() const;
};

}  // namespace frugal
