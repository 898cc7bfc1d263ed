// JSON forms of the reports, shared by the reports' to_json and the JSON-lines sink.
#pragma once

#include <nlohmann/json.hpp>

#include "frugal/train/step_report.h"

namespace frugal::detail {

nlohmann::json to_json_object(const StepReport& report);
nlohmann::json to_json_object(const EvalReport& report);

}  // namespace frugal::detail
