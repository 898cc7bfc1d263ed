#include "phase_timer.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "../compat.h"

namespace frugal::detail {

// c10::Event reads the time between two events from LibTorch 2.6 on.
#if FRUGAL_TORCH_AT_LEAST(2, 6)
#define FRUGAL_EVENT_TIMING 1
#endif

struct PhaseTimer::Events {
#ifdef FRUGAL_EVENT_TIMING
  struct Lap {
    c10::Event event;
    double* into;
  };
  explicit Events(const c10::Device& device) : device(device), start(record()) {}
  c10::Event record() const {
    c10::Event event(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    event.record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
    return event;
  }
  c10::Device device;
  c10::Event start;
  std::vector<Lap> laps;
#endif
};

PhaseTimer::PhaseTimer() = default;
PhaseTimer::~PhaseTimer() = default;
PhaseTimer::PhaseTimer(PhaseTimer&&) noexcept = default;
PhaseTimer& PhaseTimer::operator=(PhaseTimer&&) noexcept = default;

void PhaseTimer::begin(const c10::Device& device, bool events, bool wait) {
  device_ = device;
  const bool on_device = !device.is_cpu();
#ifdef FRUGAL_EVENT_TIMING
  events_ = on_device && events;
  wait_ = on_device && wait && !events_;
#else
  events_ = false;
  wait_ = on_device && (wait || events);  // no events to read: the waits instead
#endif
  recorded_.reset();
  start_ = mark_ = Clock::now();
#ifdef FRUGAL_EVENT_TIMING
  if (events_) {
    recorded_ = std::make_unique<Events>(device);
  }
#endif
}

void PhaseTimer::lap(double* into, bool device_work) {
#ifdef FRUGAL_EVENT_TIMING
  if (events_) {
    recorded_->laps.push_back({recorded_->record(), into});
    return;
  }
#endif
  if (wait_ && device_work) {
    wait_for(device_);
  }
  const double ms = detail::lap(mark_);
  if (into != nullptr) {
    *into += ms;
  }
}

double PhaseTimer::finish() {
#ifdef FRUGAL_EVENT_TIMING
  if (events_ && recorded_ != nullptr) {
    auto& r = *recorded_;
    const auto end = r.record();
    end.synchronize();  // the step's one wait for the device
    const c10::Event* previous = &r.start;
    for (auto& lap : r.laps) {
      if (lap.into != nullptr) {
        *lap.into += previous->elapsedTime(lap.event);
      }
      previous = &lap.event;
    }
    const double total = r.start.elapsedTime(end);
    recorded_.reset();
    return total;
  }
#endif
  if (wait_) {
    wait_for(device_);
  }
  return ms_since(start_);
}

}  // namespace frugal::detail
