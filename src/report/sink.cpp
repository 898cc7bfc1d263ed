#include "frugal/report/sink.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "../report_json.h"
#include "frugal/error.h"

namespace frugal {
namespace {

// One report line: the report's fields and the sink's extra fields (kept as JSON text).
std::string line_with(nlohmann::json line, const std::map<std::string, std::string>& extra) {
  for (const auto& [key, value] : extra) {
    line[key] = nlohmann::json::parse(value);
  }
  return line.dump();
}

}  // namespace

ConsoleSink::ConsoleSink(std::FILE* out, std::int64_t every) : out_(out), every_(every) {
  FRUGAL_CHECK(out_ != nullptr, "frugal: ConsoleSink needs a stream");
  FRUGAL_CHECK(every_ >= 1, "frugal: ConsoleSink prints every N steps, N >= 1, got ", every_);
}

void ConsoleSink::write(const StepReport& report) {
  if (report.batch % every_ == 0) {
    fmt::print(out_, "{}\n", report.summary());
    std::fflush(out_);
  }
}

void ConsoleSink::write(const EvalReport& report) {
  fmt::print(out_, "{}\n", report.summary());
  std::fflush(out_);
}

void ConsoleSink::write(const LoopReport& report) {
  if (report.iteration % every_ == 0) {
    fmt::print(out_, "{}\n", report.summary());
    std::fflush(out_);
  }
}

JsonLinesSink::JsonLinesSink(const std::string& path) : path_(path), out_(path) {
  FRUGAL_CHECK(out_.good(), "frugal: cannot open the report file '", path, "' for writing");
}

void JsonLinesSink::set(const std::string& key, double value) {
  extra_[key] = nlohmann::json(value).dump();
}

void JsonLinesSink::set(const std::string& key, const std::string& value) {
  extra_[key] = nlohmann::json(value).dump();
}

void JsonLinesSink::set(const std::string& key, std::int64_t value) {
  extra_[key] = nlohmann::json(value).dump();
}

void JsonLinesSink::write(const StepReport& report) {
  write_line(line_with(detail::to_json_object(report), extra_));
}

void JsonLinesSink::write(const EvalReport& report) {
  write_line(line_with(detail::to_json_object(report), extra_));
}

void JsonLinesSink::write(const LoopReport& report) {
  write_line(line_with(detail::to_json_object(report), extra_));
}

void JsonLinesSink::write_event(const std::string& event) {
  write_line(line_with(nlohmann::json{{"event", event}}, extra_));
}

void JsonLinesSink::write_line(const std::string& line) {
  out_ << line << '\n';
  out_.flush();
  FRUGAL_CHECK(out_.good(), "frugal: writing the report file '", path_, "' failed");
}

}  // namespace frugal
