// How the planner picks one of the plans it measured.
#pragma once

#include <vector>

#include "frugal/compose/planner.h"

namespace frugal::detail {

/// The planner's choice among `options` (see MemoryPlanner), or null when none fits.
const PlanOption* choose_plan(const std::vector<PlanOption>& options, double time_tolerance);

}  // namespace frugal::detail
