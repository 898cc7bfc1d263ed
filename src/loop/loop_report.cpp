// What one iteration of a frugal::Loop reports: looked up by model, summarised in a line,
// written as one JSON object.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "../report_json.h"
#include "frugal/error.h"
#include "frugal/loop/loop.h"
#include "frugal/memory/format.h"

namespace frugal {

const LoopModelReport& LoopReport::model(const std::string& name) const {
  for (const auto& m : models) {
    if (m.name == name) {
      return m;
    }
  }
  FRUGAL_CHECK(false, "frugal: the loop report has no model named '", name, "'");
  return models.front();  // not reached
}

std::string LoopReport::summary() const {
  std::string out = fmt::format("iteration {}", iteration);
  for (const auto& m : models) {
    out += fmt::format(" | {} loss {:.4f}{}", m.name, m.loss, m.skipped ? " (skipped)" : "");
  }
  for (const auto& [name, value] : metrics) {
    out += fmt::format(" | {} {:.4f}", name, value);
  }
  return out +
         fmt::format(" | allocated {} peak {}", format_bytes(memory.allocated), format_bytes(peak));
}

std::string LoopReport::to_json() const { return detail::to_json_object(*this).dump(); }

namespace detail {

nlohmann::json to_json_object(const LoopReport& r) {
  nlohmann::json models = nlohmann::json::array();
  for (const auto& m : r.models) {
    models.push_back({{"name", m.name},
                      {"loss", m.loss},
                      {"backwards", m.backwards},
                      {"stepped", m.stepped},
                      {"skipped", m.skipped},
                      {"oom_retries", m.oom_retries},
                      {"steps", m.steps}});
  }
  nlohmann::json j = {{"event", "iteration"},
                      {"iteration", r.iteration},
                      {"models", models},
                      {"scale", r.scale},
                      {"metrics", r.metrics}};
  j.update(memory_fields(r.memory, r.peak, r.ledger));
  return j;
}

}  // namespace detail

}  // namespace frugal
