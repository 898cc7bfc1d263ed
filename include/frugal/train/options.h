// Options of the step engine, in LibTorch's chained-setter style.
#pragma once

#include <c10/util/Optional.h>
#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "frugal/memory/probe.h"
#include "frugal/train/batch.h"
#include "frugal/train/step_report.h"

namespace frugal {

/// How Trainer::evaluate runs.
///
/// Example:
///   trainer.evaluate(test_set, frugal::EvaluateOptions().batch_size(256));
struct EvaluateOptions {
  /// Samples a chunk (default: the eval_batch option, else the micro-batch, else all).
  TORCH_ARG(c10::optional<std::int64_t>, batch_size) = c10::nullopt;
  /// Applied to the report before the sinks receive it and it is returned: for a caller that
  /// combines reports (distributed::evaluate sums the ranks').
  TORCH_ARG(std::function<void(EvalReport&)>, combine);
};

/// How the loss function reduces over a (micro-)batch, and so what the step trains on.
/// Exact across micro-batches: the gradient is the unsplit batch's, and over an accumulation
/// window that of the window's batches as one. Reports and evaluate() give the loss per
/// count (sample or token) in every reduction, as pytorch/examples print a summed loss.
enum class LossReduction {
  /// The loss is a mean over its micro-batch's count; the step trains on the batch's mean
  /// (each micro-batch weighted by its share of the global count). PyTorch's default.
  Mean,
  /// The loss is a sum over its micro-batch; the step trains on the batch's sum, as the
  /// unsplit program with reduction='sum' does (a VAE's loss).
  Sum,
  /// The loss is a sum over its micro-batch; the step trains on that sum divided by the
  /// batch's global count (a token-summed loss over the batch's non-padding tokens).
  SumOverCount,
};

/// What the trainer does when micro-batches would change what a layer computes from the
/// batch (BatchNorm normalizes by the batch's mean and variance and updates its running
/// statistics once per forward): each micro-batch is then normalized by its own statistics,
/// so the gradient is not the whole batch's. GroupNorm and LayerNorm are exact under
/// micro-batches; leaving micro_batch unset keeps BatchNorm exact.
enum class BatchStatistics {
  Warn,    ///< warn once per trainer, naming the layers, and go on
  Accept,  ///< go on silently
  Refuse,  ///< refuse the step, with an error naming the layers, before anything runs
  /// Keep BatchNorm exact where memory allows: a model with such layers (in training mode
  /// when the Trainer is made) runs each batch whole, micro_batch and micro_batches set
  /// aside; a model without them is micro-batched as asked. Should a batch be cut after all
  /// (OomRecovery halving it after an out-of-memory error), warn once as Warn does.
  WholeBatch,
};

/// How a step's phase times (StepReport::time) are taken on a GPU, where work runs after its
/// launch has returned. On the CPU each is the clock between the phase boundaries.
enum class DeviceTiming {
  /// Events recorded on the device's current stream at each phase boundary and read when the
  /// step ends: each phase's time on the device, for one host wait a step (LibTorch 2.6 and
  /// later; Synchronize before).
  Events,
  /// The host waits for the device at every phase boundary (two waits a micro-batch and
  /// more): the host's work is timed with the device's, and the two no longer overlap.
  Synchronize,
  /// No waits: the host's time to launch each phase (its work is counted in whichever later
  /// phase waits for it).
  Launches,
};

/// Numbers of one micro-batch's output for the step's report (correct predictions, say):
/// summed over the batch's micro-batches into StepReport::metrics.
using MetricsFn =
    std::function<std::map<std::string, double>(const torch::Tensor& output, const Batch& micro)>;

/// Options of frugal::Trainer.
///
/// Example:
///   auto options = frugal::TrainerOptions().micro_batch(16).accumulate(2).set_to_none(true);
struct TrainerOptions {
  /// Split each batch into micro-batches of at most this many samples (>= 1).
  /// Larger than the batch means one micro-batch. Unset: the whole batch at once.
  TORCH_ARG(c10::optional<std::int64_t>, micro_batch) = c10::nullopt;
  /// Or split each batch into this many near-equal parts (>= 1); exclusive with micro_batch.
  TORCH_ARG(c10::optional<std::int64_t>, micro_batches) = c10::nullopt;
  /// Batches per optimizer step (>= 1). The gradient is that of the mean loss over all
  /// their samples (or counts); `Trainer::flush` steps a last partial window.
  TORCH_ARG(std::int64_t, accumulate) = 1;
  /// Release gradients after each optimizer step instead of filling them with zeros.
  TORCH_ARG(bool, set_to_none) = true;
  /// Micro-batches over layers with batch statistics (BatchNorm); see BatchStatistics.
  TORCH_ARG(BatchStatistics, batch_statistics) = BatchStatistics::Warn;
  /// Counted on each micro-batch's output (detached, under no_grad) and summed into the
  /// step's StepReport::metrics, so the loss function need not count them. Only with a forward
  /// (not with a loss of the batch alone).
  ///
  /// Example:
  ///   .metrics([](const torch::Tensor& logits, const frugal::Batch& b) {
  ///     return std::map<std::string, double>{
  ///         {"correct", logits.argmax(1).eq(b.targets).sum().item<double>()}};
  ///   })
  TORCH_ARG(MetricsFn, metrics) = nullptr;
  /// How the loss function reduces; see LossReduction.
  TORCH_ARG(LossReduction, reduction) = LossReduction::Mean;
  /// The global count of a (micro-)batch, e.g. non-padding tokens. Unset: samples.
  TORCH_ARG(std::function<std::int64_t(const Batch&)>, count) = nullptr;
  /// Where micro-batches are moved before the forward pass, one at a time.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// Samples per evaluation batch. Unset: the micro-batch size, else the whole set.
  TORCH_ARG(c10::optional<std::int64_t>, eval_batch) = c10::nullopt;
  /// Evaluate under c10::InferenceMode rather than torch::NoGradGuard.
  TORCH_ARG(bool, inference_mode) = false;
  /// Targets equal to this are left out of EvalReport::accuracy (padding; PyTorch's
  /// cross_entropy default).
  TORCH_ARG(std::int64_t, ignore_index) = -100;
  /// Skip the optimizer step when the step's loss is NaN or infinite (or, with
  /// check_gradients, any gradient is): the weights are not poisoned; the report says
  /// `skipped` and `non_finite`, and Trainer::skipped_steps() counts it. Policies that
  /// handle non-finite values themselves (GradScaler) take over from it.
  TORCH_ARG(bool, skip_non_finite) = true;
  /// Also scan every gradient before the step for NaN/inf (one pass over the gradients);
  /// otherwise only the loss, which costs nothing, is checked.
  TORCH_ARG(bool, check_gradients) = false;
  /// Measure the ledger (weights, gradients, optimizer state) in every report. The
  /// module's parameters and buffers are read from its tree when the Trainer is made and
  /// when a policy is added (and again whenever one of them has been freed, as when a
  /// buffer is replaced), not at every step: a module that registers new ones later
  /// shows them under `other` until then.
  TORCH_ARG(bool, ledger) = true;
  /// Whose bytes the reports' allocated figure and peaks count on the CPU: the thread that
  /// calls step() (so trainers on several threads see their own, and LeakGuard is not
  /// fooled by another thread), or the whole process. The ledger is always process-wide.
  TORCH_ARG(MemoryScope, memory_scope) = MemoryScope::Thread;
  /// How the phase times are taken on a GPU (see DeviceTiming).
  TORCH_ARG(DeviceTiming, device_timing) = DeviceTiming::Events;
};

}  // namespace frugal
