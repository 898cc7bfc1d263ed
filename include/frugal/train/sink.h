// Where a trainer's reports go: the interface, beside the reports it receives.
#pragma once

#include "frugal/train/step_report.h"

namespace frugal {

/// Receives every report of a Trainer it was added to (Trainer::add_sink). frugal's own
/// sinks, ConsoleSink and JsonLinesSink, are in frugal/report/sink.h.
///
/// Example:
///   struct Losses : frugal::ReportSink {
///     void write(const frugal::StepReport& r) override { losses.push_back(r.loss); }
///     void write(const frugal::EvalReport&) override {}
///     std::vector<double> losses;
///   };
class ReportSink {
 public:
  virtual ~ReportSink() = default;
  virtual void write(const StepReport& report) = 0;
  virtual void write(const EvalReport& report) = 0;
};

}  // namespace frugal
