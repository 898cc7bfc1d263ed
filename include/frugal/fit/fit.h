// The fit loop: epochs of shuffled batches through a Trainer, evaluation, LR schedules by
// policy, saving every N steps and on SIGINT/SIGTERM, and resuming from a folder.
#pragma once

#include <c10/util/Optional.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "frugal/fit/data_source.h"
#include "frugal/fit/ranks.h"
#include "frugal/state/save_dir.h"
#include "frugal/train/step_report.h"

namespace frugal {

class Trainer;

/// Where a fit run stands: epochs count from 1, batches within the epoch from 1.
struct FitPosition {
  std::int64_t epoch = 1;
  std::int64_t batch = 0;  ///< batches of this epoch done
  std::int64_t batches_per_epoch = 0;
  std::int64_t step = 0;  ///< the trainer's optimizer steps, from the start of the run
  bool end_of_epoch = false;
};

struct FitOptions {
  using PositionFn = std::function<void(const FitPosition&)>;
  using StepFn = std::function<void(const StepReport&, const FitPosition&)>;
  using EvalFn = std::function<void(const EvalReport&, const FitPosition&)>;
  using SaveFn = std::function<void(UserState&)>;
  using ResumeFn = std::function<void(const UserState&)>;
  using LogFn = std::function<void(const std::string&)>;

  /// Epochs, counted from the start of the run (also after a resume).
  TORCH_ARG(std::int64_t, epochs) = 1;
  /// Samples per trainer step (the trainer splits it into micro-batches).
  TORCH_ARG(std::int64_t, batch_size) = 32;
  /// Stop after this many optimizer steps from the start of the run (0: no limit).
  TORCH_ARG(std::int64_t, max_steps) = 0;
  /// Each epoch in the order of the next torch::randperm of a generator seeded with `seed`.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(std::uint64_t, seed) = 0;
  /// Evaluate every this many optimizer steps (0: at the end of each epoch and run).
  TORCH_ARG(std::int64_t, eval_every) = 0;
  /// Folder of saved states (frugal::SaveDir); empty: no saving.
  TORCH_ARG(std::string, save_dir) = "";
  /// Save every this many optimizer steps (0: only at the end and on a signal).
  TORCH_ARG(std::int64_t, save_every) = 0;
  /// Saved states kept in save_dir.
  TORCH_ARG(std::int64_t, keep) = 3;
  /// Resume from the newest loadable state in save_dir (a fresh start when there is none).
  TORCH_ARG(bool, resume) = false;
  /// On SIGINT or SIGTERM, finish the step (and the accumulation window), save, and return
  /// with FitResult::signal set. The previous handlers are back when fit returns. One fit
  /// at a time per process should handle signals (the flag is the process's).
  TORCH_ARG(bool, handle_signals) = true;
  /// The processes this run is shared among (default: this one). Data-parallel:
  /// `std::make_shared<frugal::distributed::GroupRanks>(group)`, with the trainer under a
  /// distributed::DataParallel policy: batch_size stays the global batch, every rank draws
  /// the same order and takes its share of each batch (a last batch smaller than the group
  /// is left out), evaluation is shared, only rank 0 writes saves and every rank resumes from
  /// its files, except under a sharded optimizer (distributed::ZeroOptimizer), whose state
  /// differs by rank: each rank then saves in and resumes from save_dir/rank-R. A signal on
  /// any rank stops all of them after the same step.
  TORCH_ARG(std::shared_ptr<Ranks>, ranks);

  /// At the start of each epoch, and of the rest of one a resumed run goes on with.
  TORCH_ARG(PositionFn, on_epoch_begin);
  TORCH_ARG(StepFn, on_step);
  TORCH_ARG(EvalFn, on_eval);
  /// Adds the caller's own values to each save; on_resume gets them back.
  TORCH_ARG(SaveFn, on_save);
  TORCH_ARG(ResumeFn, on_resume);
  /// Where notices go (resumed from, fell back to an older save, saved on a signal);
  /// default: standard error.
  TORCH_ARG(LogFn, log);
};

struct FitResult {
  std::int64_t steps = 0;    ///< the trainer's optimizer steps at the end
  FitPosition position;      ///< where the run stopped
  int signal = 0;            ///< SIGINT or SIGTERM when stopped by one, else 0
  std::string resumed_from;  ///< the save file the run resumed from, or empty
  std::string saved;         ///< the last save file written, or empty
  EvalReport eval;           ///< the last evaluation (samples == 0: none)
};

/// Where fit takes its batches from, epoch by epoch: fit makes one of a DataSource (shuffled
/// by fit, shared among the ranks) or of any iterable of batches; a program may give its own.
class FitBatches {
 public:
  virtual ~FitBatches() = default;
  /// Batches an epoch has, or -1 where that is known only at the epoch's end.
  virtual std::int64_t per_epoch() const = 0;
  /// Starts epoch `epoch` (from 1) after its first `done` batches (a resumed run).
  virtual void begin(std::int64_t epoch, std::int64_t done) = 0;
  /// The epoch's next batch, or none at its end; a batch without inputs counts as a batch
  /// but is not trained on (too small to share among the ranks).
  virtual c10::optional<Batch> next() = 0;
};

/// The batches of an iterable (a torch::data DataLoader, a std::vector of Batch), one pass
/// an epoch, each converted by frugal::to_batch.
template <typename Batches>
class IterableBatches : public FitBatches {
 public:
  explicit IterableBatches(Batches& batches) : batches_(batches) {}
  std::int64_t per_epoch() const override { return -1; }
  void begin(std::int64_t, std::int64_t done) override {
    it_.reset();
    it_.emplace(std::begin(batches_));
    for (std::int64_t i = 0; i < done && *it_ != std::end(batches_); ++i) {
      ++*it_;
    }
  }
  c10::optional<Batch> next() override {
    if (!it_ || *it_ == std::end(batches_)) {
      return c10::nullopt;
    }
    auto batch = to_batch(**it_);
    ++*it_;
    return batch;
  }

 private:
  Batches& batches_;
  std::optional<decltype(std::begin(std::declval<Batches&>()))> it_;
};

/// Trains `trainer` on `train` under `options`, evaluating on `eval` when it has inputs.
/// An epoch that ends inside an accumulation window steps it (Trainer::flush). Saves are
/// made only between optimizer steps; a resumed run meets the same batches and gets the
/// same weights, bit for bit, as one never stopped.
///
/// Example:
///   frugal::TensorData train({images, labels});
///   auto result = frugal::fit(trainer, train,
///                             frugal::FitOptions().epochs(3).batch_size(64).seed(1)
///                                 .save_dir("run").save_every(500).resume(true),
///                             {test_images, test_labels});
FitResult fit(Trainer& trainer, const DataSource& train, const FitOptions& options = {},
              const Batch& eval = {});
/// The same over batches a FitBatches gives; options.batch_size and shuffle are its own.
FitResult fit(Trainer& trainer, FitBatches& train, const FitOptions& options = {},
              const Batch& eval = {});
/// The same over an iterable of batches, a torch::data DataLoader (`*loader`) or a vector of
/// Batch: one pass an epoch, in its order, its batch size. A resumed run skips the batches of
/// its epoch already done, so the order must repeat (a sequential sampler, or one seeded per
/// epoch). Under ranks, each process's iterable yields that process's share.
///
/// Example:
///   auto loader = torch::data::make_data_loader(
///       dataset.map(torch::data::transforms::Stack<>()), 64);
///   frugal::fit(trainer, *loader, frugal::FitOptions().epochs(3));
template <typename Batches,
          typename = std::enable_if_t<!std::is_base_of_v<DataSource, Batches> &&
                                      !std::is_base_of_v<FitBatches, Batches>>,
          typename = decltype(std::begin(std::declval<Batches&>()))>
FitResult fit(Trainer& trainer, Batches& train, const FitOptions& options = {},
              const Batch& eval = {}) {
  IterableBatches<Batches> batches(train);
  return fit(trainer, static_cast<FitBatches&>(batches), options, eval);
}

}  // namespace frugal
