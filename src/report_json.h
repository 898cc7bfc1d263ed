// JSON forms of the reports, shared by the reports' to_json and the JSON-lines sink.
#pragma once

#include <nlohmann/json.hpp>

#include "frugal/loop/loop.h"
#include "frugal/train/step_report.h"

namespace frugal::detail {

/// The memory fields every report has: allocated, peak, scope, reserved and the ledger.
nlohmann::json memory_fields(const MemorySnapshot& memory, std::int64_t peak, const Ledger& ledger);

nlohmann::json to_json_object(const StepReport& report);
nlohmann::json to_json_object(const EvalReport& report);
nlohmann::json to_json_object(const LoopReport& report);

}  // namespace frugal::detail
