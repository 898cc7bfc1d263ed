#include "frugal/train/step_report.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "../report_json.h"
#include "frugal/memory/format.h"

namespace frugal {

std::string StepReport::summary() const {
  std::string counted;
  for (const auto& [name, value] : metrics) {
    counted += fmt::format(" | {} {}", name, value);
  }
  return fmt::format(
      "step {:>5} loss {:.4f} | {} x {} | {:.1f} ms (fwd {:.1f} bwd {:.1f} opt {:.1f}) | "
      "allocated {} peak {} | {}{}{}{}",
      step, loss, micro_batches, micro_batch, time.total_ms, time.forward_ms, time.backward_ms,
      time.optimizer_ms, format_bytes(memory.allocated), format_bytes(peak), ledger.summary(),
      non_finite ? " | skipped (loss or gradients not finite)"
      : skipped  ? " | skipped"
                 : "",
      oom_retries > 0 ? fmt::format(" | {} OOM retries", oom_retries) : std::string(), counted);
}

std::string StepReport::to_json() const { return detail::to_json_object(*this).dump(); }

std::string EvalReport::summary() const {
  return fmt::format(
      "eval after step {}: loss {:.4f}{} | {} samples in {} batches of {} | "
      "{:.1f} ms | peak {}",
      step, loss, accuracy >= 0 ? fmt::format(" accuracy {:.4f}", accuracy) : std::string(),
      samples, batches, batch_size, time_ms, format_bytes(peak));
}

std::string EvalReport::to_json() const { return detail::to_json_object(*this).dump(); }

namespace detail {

nlohmann::json memory_fields(const MemorySnapshot& memory, std::int64_t peak,
                             const Ledger& ledger) {
  return {{"allocated_bytes", memory.allocated},
          {"peak_bytes", peak},
          {"memory_scope", memory.scope == MemoryScope::Thread ? "thread" : "process"},
          {"process_allocated_bytes", memory.process_allocated},
          {"reserved_bytes", memory.reserved},
          {"weights_bytes", ledger.weights},
          {"grads_bytes", ledger.gradients},
          {"optimizer_bytes", ledger.optimizer},
          {"other_bytes", ledger.other}};
}

nlohmann::json to_json_object(const StepReport& r) {
  nlohmann::json j = {{"step", r.step},
                      {"batch", r.batch},
                      {"stepped", r.stepped},
                      {"loss", r.loss},
                      {"samples", r.samples},
                      {"count", r.count},
                      {"micro_batch", r.micro_batch},
                      {"micro_batches", r.micro_batches},
                      {"oom_retries", r.oom_retries},
                      {"skipped", r.skipped},
                      {"non_finite", r.non_finite},
                      {"skipped_total", r.skipped_total},
                      {"scale", r.scale},
                      {"lr", r.lr},
                      {"time_ms", r.time.total_ms},
                      {"data_ms", r.time.data_ms},
                      {"forward_ms", r.time.forward_ms},
                      {"backward_ms", r.time.backward_ms},
                      {"optimizer_ms", r.time.optimizer_ms},
                      {"forward_peak_bytes", r.forward_peak},
                      {"backward_peak_bytes", r.backward_peak}};
  j.update(memory_fields(r.memory, r.peak, r.ledger));
  if (!r.metrics.empty()) {
    j["metrics"] = r.metrics;
  }
  return j;
}

nlohmann::json to_json_object(const EvalReport& r) {
  nlohmann::json j = {{"event", "eval"},
                      {"step", r.step},
                      {"loss", r.loss},
                      {"samples", r.samples},
                      {"batch_size", r.batch_size},
                      {"batches", r.batches},
                      {"oom_retries", r.oom_retries},
                      {"time_ms", r.time_ms}};
  if (r.accuracy >= 0) {
    j["accuracy"] = r.accuracy;
    j["scored"] = r.scored;
  }
  j.update(memory_fields(r.memory, r.peak, r.ledger));
  return j;
}

}  // namespace detail
}  // namespace frugal
