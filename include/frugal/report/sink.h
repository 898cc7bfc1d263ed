// The sinks frugal has: a console line, or one JSON object a line in a file.
#pragma once

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "frugal/train/sink.h"
#include "frugal/train/step_report.h"

namespace frugal {

/// One line a report, to a stream (stdout by default), every `every`-th step.
///
/// Example:
///   trainer.add_sink(std::make_shared<frugal::ConsoleSink>(stdout, 10));
class ConsoleSink : public ReportSink {
 public:
  explicit ConsoleSink(std::FILE* out = stdout, std::int64_t every = 1);
  void write(const StepReport& report) override;
  void write(const EvalReport& report) override;
  /// A Loop iteration's summary line, every `every`-th iteration.
  void write(const LoopReport& report) override;

 private:
  std::FILE* out_;
  std::int64_t every_;
};

/// One JSON object a line: every step report, eval reports with "event": "eval" and Loop
/// iterations with "event": "iteration".
/// Fields set with `set` (an epoch, a run name) are added to every line that follows.
///
/// Example:
///   auto jsonl = std::make_shared<frugal::JsonLinesSink>("run.jsonl");
///   jsonl->set("epoch", 1);
class JsonLinesSink : public ReportSink {
 public:
  explicit JsonLinesSink(const std::string& path);
  void set(const std::string& key, double value);
  void set(const std::string& key, std::int64_t value);
  void set(const std::string& key, const std::string& value);
  void write(const StepReport& report) override;
  void write(const EvalReport& report) override;
  /// A Loop iteration, with "event": "iteration".
  void write(const LoopReport& report) override;
  /// A line of its own, {"event": event} with the fields set so far: the end of a run, say.
  void write_event(const std::string& event);

 private:
  void write_line(const std::string& line);
  std::string path_;
  std::ofstream out_;
  std::map<std::string, std::string> extra_;  // key -> JSON text of the value
};

}  // namespace frugal
