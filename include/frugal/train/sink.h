// Where the reports go: the interface, beside the reports it receives.
#pragma once

#include "frugal/train/step_report.h"

namespace frugal {

struct LoopReport;

/// Receives every report of each Trainer (Trainer::add_sink) and Loop (Loop::add_sink) it
/// was added to; a sink overrides the reports it wants, the others are dropped. frugal's own
/// sinks, ConsoleSink and JsonLinesSink, are in frugal/report/sink.h.
///
/// Example:
///   struct Losses : frugal::ReportSink {
///     void write(const frugal::StepReport& r) override { losses.push_back(r.loss); }
///     std::vector<double> losses;
///   };
class ReportSink {
 public:
  virtual ~ReportSink() = default;
  /// A Trainer's step.
  virtual void write(const StepReport& /*report*/) {}
  /// A Trainer's evaluation.
  virtual void write(const EvalReport& /*report*/) {}
  /// A Loop's iteration (Loop::end).
  virtual void write(const LoopReport& /*report*/) {}
};

}  // namespace frugal
