// How a ZeroOptimizer lays the parameters out: units, each a flat buffer cut in N ranges,
// and this rank's ranges of all units side by side in one shard.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "frugal/distributed/group.h"
#include "optim/weight_codes.h"

namespace frugal::distributed::detail {

/// Parameters gathered and released together: stage 3 makes one of each chosen module and
/// one root unit of the rest; stages 1 and 2 make one unit of everything.
struct ZeroUnit {
  std::vector<std::size_t> members;   // positions in ZeroLayout::params
  std::int64_t total = 0;             // its parameters' elements
  std::int64_t range = 0;             // each rank's share: ceil(total / N)
  std::int64_t shard_offset = 0;      // where this rank's share starts in the shard
  torch::Tensor flat;                 // N ranges, padded; stage 3: bytes while whole or arriving
  std::vector<Work> arriving;         // a prefetch's all-gathers into `flat`, in flight
  c10::optional<c10::Stream> stream;  // the stream current when `flat` took its bytes
  bool viewed = false;                // the parameters view `flat` (the unit is whole)
  std::size_t awaiting = 0;           // backward: gradients not accumulated yet
  bool counting = false;              // backward has reached the unit
};

struct ZeroLayout {
  std::vector<torch::Tensor> params;
  std::vector<std::size_t> unit_of;
  std::vector<std::int64_t> offsets;  // where each parameter starts in its unit's flat order
  std::vector<std::int64_t> numels;
  std::vector<std::vector<std::int64_t>> shapes;
  std::unordered_map<const void*, std::size_t> index;  // TensorImpl -> position
  std::vector<ZeroUnit> units;                         // units[0]: the root
  std::int64_t total = 0;                              // all parameters' elements
  std::shared_ptr<Group> group;
  torch::Tensor shard;  // this rank's ranges of every unit, in unit order
  // ZeroOptimizerOptions::int8_ranges: each unit's range as codes instead (no shard).
  std::vector<std::shared_ptr<optim::detail::StoredWeights>> coded;
  std::int64_t gather_bytes = 0;
  bool pinned = false;  // gathered whole on request: units stay whole after their calls
  bool prefetch = false;
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::size_t prefetched = kNone;  // the unit gathered ahead and not used yet (one at most)
  std::vector<std::size_t> order;  // units in the order the last forward first called them
  std::vector<std::size_t> trace;  // ... the forward running now

  /// Lays out `params` (in order) as the root unit and one unit a group of `unit_members`
  /// (positions), for `ranks` ranks.
  ZeroLayout(std::vector<torch::Tensor> params_in,
             const std::vector<std::vector<std::size_t>>& unit_members, std::int64_t ranks);

  std::int64_t shard_size() const;
  bool whole(std::size_t u) const { return units[u].viewed; }
  /// Whether unit `u`'s flat buffer has its bytes (whole, or a prefetch arriving).
  bool held(std::size_t u) const { return units[u].flat.storage().nbytes() > 0; }
  bool all_whole() const;
  /// Every parameter of unit `u` becomes a view of its place in the unit's flat buffer.
  void view_flat(std::size_t u);
  /// Stage 3: every rank's share of unit `u` into a new flat buffer (collective), or the
  /// wait for a prefetch of it.
  void gather(std::size_t u);
  /// With `prefetch`: starts gathering unit `u` without waiting, unless it is whole or
  /// arriving already, or another unit's prefetch is not used yet.
  void prefetch_unit(std::size_t u);
  /// A unit's forward begins: records the order, prefetches the next unit in it.
  void forward_reached(std::size_t u);
  /// A unit's backward begins: prefetches the unit before it in the forward order.
  void backward_reached(std::size_t u);
  /// A step or an evaluation begins: the last forward's order is the one to prefetch by.
  void begin_pass();
  /// Stage 3: unit `u`'s parameters are emptied and its flat buffer goes; gradients stay.
  void release(std::size_t u);
  /// Every rank's share of unit `u` into its flat buffer, in pieces of gather_bytes; this
  /// rank's own share too when `own_too`.
  void all_gather(std::size_t u, bool own_too);
  /// Stage 3: a new flat buffer for unit `u` and the all-gathers into it, not waited for.
  void start_gather(std::size_t u);
  /// This rank's share of unit `u` (a view of the shard).
  torch::Tensor share(std::size_t u) const;
};

}  // namespace frugal::distributed::detail
