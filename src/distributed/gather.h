// A few numbers from every rank: what the ranks compare when they join (process ids), resume
// (the steps each holds) and normalize together (SyncBatchNorm's channel counts).
#pragma once

#include <cstdint>
#include <vector>

#include "frugal/distributed/group.h"

namespace frugal::distributed::detail {

/// Every rank's `values`, by rank (as many values on every rank); one all-gather, waited for.
std::vector<std::vector<std::int64_t>> gather_numbers(Group& group,
                                                      const std::vector<std::int64_t>& values);

}  // namespace frugal::distributed::detail
