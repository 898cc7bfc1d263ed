// How a ZeroOptimizer lays the parameters out: units, each a flat buffer cut in N ranges,
// and this rank's ranges of all units side by side in one shard.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "frugal/distributed/group.h"

namespace frugal::distributed::detail {

/// Parameters gathered and released together: stage 3 makes one of each chosen module and
/// one root unit of the rest; stages 1 and 2 make one unit of everything.
struct ZeroUnit {
  std::vector<std::size_t> members;  // positions in ZeroLayout::params
  std::int64_t total = 0;            // its parameters' elements
  std::int64_t range = 0;            // each rank's share: ceil(total / N)
  std::int64_t shard_offset = 0;     // where this rank's share starts in the shard
  torch::Tensor flat;                // N ranges, padded; stage 3: only while whole
  std::size_t awaiting = 0;          // backward: gradients not accumulated yet
  bool counting = false;             // backward has reached the unit
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
  std::int64_t gather_bytes = 0;
  bool pinned = false;  // gathered whole on request: units stay whole after their calls

  /// Lays out `params` (in order) as the root unit and one unit a group of `unit_members`
  /// (positions), for `ranks` ranks.
  ZeroLayout(std::vector<torch::Tensor> params_in,
             const std::vector<std::vector<std::size_t>>& unit_members, std::int64_t ranks);

  std::int64_t shard_size() const;
  bool whole(std::size_t u) const { return units[u].flat.defined(); }
  bool all_whole() const;
  /// Every parameter of unit `u` becomes a view of its place in the unit's flat buffer.
  void view_flat(std::size_t u);
  /// Stage 3: every rank's share of unit `u` into a new flat buffer (collective).
  void gather(std::size_t u);
  /// Stage 3: unit `u`'s parameters are emptied and its flat buffer goes; gradients stay.
  void release(std::size_t u);
  /// Every rank's share of unit `u` into its flat buffer, in pieces of gather_bytes; this
  /// rank's own share too when `own_too`.
  void all_gather(std::size_t u, bool own_too);
  /// This rank's share of unit `u` (a view of the shard).
  torch::Tensor share(std::size_t u) const;
};

}  // namespace frugal::distributed::detail
