// The engine's phase timer: a step's time split by phase, on the device's own clock where
// reading it costs no more than one wait a step.
#pragma once

#include <c10/core/Device.h>

#include <memory>
#include <vector>

#include "clock.h"

namespace frugal::detail {

/// Times the phases of one step. `begin` starts the step; each `lap` ends a phase and adds
/// its time to a figure of the step's report; `finish` ends the step and returns its time.
/// How the device is timed (CPU: the clock, always):
/// - events: an event is recorded on the device's current stream at each boundary; the
///   phases' times are read from them in `finish`, the step's one wait for the device;
/// - wait: the host waits for the device before each boundary's clock read;
/// - neither: the host's clock alone (the launches' time).
/// Figures passed to `lap` must outlive the step's `finish`; `begin` forgets earlier laps.
class PhaseTimer {
 public:
  PhaseTimer();
  ~PhaseTimer();
  PhaseTimer(PhaseTimer&&) noexcept;
  PhaseTimer& operator=(PhaseTimer&&) noexcept;

  void begin(const c10::Device& device, bool events, bool wait);
  /// Ends a phase: its time is added to `*into` (now, or by `finish`); nullptr drops it (a
  /// boundary that starts a phase, as a retried attempt's). `device_work`: whether the phase
  /// launched device work a waiting timer must wait for (moving data in does not).
  void lap(double* into, bool device_work = true);
  /// Ends the step: fills what the laps owe and returns the milliseconds since `begin`.
  double finish();
  /// Whether phases are timed by device events (false where LibTorch cannot read them).
  bool uses_events() const { return events_; }

 private:
  struct Events;
  c10::Device device_ = c10::kCPU;
  bool events_ = false;
  bool wait_ = false;
  Clock::time_point start_, mark_;
  std::unique_ptr<Events> recorded_;
};

}  // namespace frugal::detail
