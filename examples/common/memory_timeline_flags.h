// --memory-timeline FILE and --memory-timeline-step N: every example can write the memory
// timeline of one of its steps (.html, .pickle for PyTorch's memory viewer, or .json).
#pragma once

#include <fmt/format.h>
#include <frugal/memory/recorder.h>
#include <frugal/memory/timeline_window.h>
#include <frugal/policy/memory_timeline.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace examples {

struct TimelineFlags {
  std::string file;
  std::int64_t step = 2;  // the second: the optimizer's state exists by then
};

inline void memory_timeline_flags(CLI::App& app, TimelineFlags& flags) {
  app.add_option("--memory-timeline", flags.file,
                 "Write the memory timeline of one step: .html (a page), .png (its picture), "
                 ".pickle (PyTorch's memory viewer) or .json")
      ->check([](const std::string& path) {
        try {
          frugal::MemoryRecorder::check_path(path);
          return std::string();
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
      });
  app.add_option("--memory-timeline-step", flags.step, "The step it records (from 1)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
}

/// Says where the timeline went and what held the memory at its peak.
inline void print_timeline(const std::string& program, const frugal::MemoryRecorder& recorder,
                           const std::string& file, std::int64_t step) {
  fmt::print("{}: memory timeline of step {} written to {}\n{}: {}\n", program, step, file, program,
             recorder.peak().summary(6));
}

/// LoopOptions::memory_timeline for the flags: none without a file.
inline c10::optional<frugal::MemoryTimelineSpan> timeline_span(const TimelineFlags& flags) {
  if (flags.file.empty()) {
    return c10::nullopt;
  }
  return frugal::MemoryTimelineSpan(flags.file, flags.step);
}

/// For a loop the example writes itself: records iteration `flags.step` (from 1) of the
/// models it is given, writes the file and says so when that iteration ends.
class IterationTimeline {
 public:
  struct Watched {
    const torch::nn::Module* module;
    const torch::optim::Optimizer* optimizer;
    std::string name;
  };
  IterationTimeline(std::string program, const TimelineFlags& flags)
      : program_(std::move(program)) {
    if (const auto span = timeline_span(flags)) {
      window_ = std::make_unique<frugal::MemoryTimelineWindow>(*span);
    }
  }

  void begin(const std::vector<Watched>& watched, torch::Device device) {
    if (window_ == nullptr) {
      return;
    }
    if (auto* recorder = window_->begin(device)) {
      for (const auto& w : watched) {
        recorder->watch(*w.module, w.optimizer, w.name);
      }
    }
  }
  void end() {
    if (window_ != nullptr && window_->end()) {
      print_timeline(program_, *window_->recorder(), window_->written(), window_->span().first);
    }
  }

 private:
  std::string program_;
  std::unique_ptr<frugal::MemoryTimelineWindow> window_;
};

}  // namespace examples
