// The engine's clock: phase times that count the device's work, not its launches.
#pragma once

#include <c10/core/Device.h>
#include <torch/cuda.h>

#include <chrono>

namespace frugal::detail {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

/// Waits for the work queued on `device` when it is a CUDA device: a kernel runs after its
/// launch has returned, so a clock read without waiting counts launches, not the work.
/// Nothing to wait for on the CPU.
inline void wait_for(const c10::Device& device) {
  if (device.is_cuda()) {
    torch::cuda::synchronize(device.index());
  }
}

/// Milliseconds since `start`, once `device` has done the work queued on it.
inline double ms_since(Clock::time_point start, const c10::Device& device) {
  wait_for(device);
  return ms_since(start);
}

/// Milliseconds from `mark` to now, with `mark` moved to now: consecutive phases share the
/// clock read between them.
inline double lap(Clock::time_point& mark) {
  const auto now = Clock::now();
  const double ms = std::chrono::duration<double, std::milli>(now - mark).count();
  mark = now;
  return ms;
}

/// The same once the work queued on `device` is done.
inline double lap(Clock::time_point& mark, const c10::Device& device) {
  wait_for(device);
  return lap(mark);
}

}  // namespace frugal::detail
