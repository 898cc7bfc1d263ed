// How a batch is cut into micro-batches, and what each one counts.
#pragma once

#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "frugal/train/batch.h"

namespace frugal::detail {

/// Cuts a batch into micro-batches of a size (the last one smaller), or into a number of
/// near-equal parts, and counts each: its samples, or what a count function says (tokens,
/// say). The counts make each micro-batch's share of the batch's loss.
class MicroBatchPlan {
 public:
  using CountFn = std::function<std::int64_t(const Batch&)>;
  /// `parts`: K near-equal parts (TrainerOptions::micro_batches), used while no size is set.
  MicroBatchPlan(c10::optional<std::int64_t> parts, CountFn count);

  struct Split {
    std::vector<Batch> micros;
    std::vector<std::int64_t> counts;
    std::int64_t total = 0;
    /// Empty, keeping the lists' room for the next batch.
    void clear() {
      micros.clear();
      counts.clear();
      total = 0;
    }
  };
  /// The sizes of the micro-batches of `samples` at micro-batch size `size` (0: none set).
  std::vector<std::int64_t> sizes(std::int64_t samples, std::int64_t size) const;
  /// The batch cut by sizes(); throws when its global count is not positive.
  Split split(const Batch& batch, std::int64_t size) const;
  /// The same into `out`, whose lists keep their room from one batch to the next: a step
  /// allocates nothing to cut its batch. `out` is left empty when this throws.
  void split_into(const Batch& batch, std::int64_t size, Split& out) const;
  /// What `micro` counts; throws on a negative count.
  std::int64_t count(const Batch& micro) const;

 private:
  // Calls `part(n)` for each micro-batch's size n, in order, as sizes() lists them.
  template <typename Part>
  void for_each_size(std::int64_t samples, std::int64_t size, Part part) const;

  c10::optional<std::int64_t> parts_;
  CountFn count_;
};

}  // namespace frugal::detail
