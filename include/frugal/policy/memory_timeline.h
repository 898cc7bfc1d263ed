// Records chosen steps of a Trainer with a MemoryRecorder and writes the file.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "frugal/memory/recorder.h"
#include "frugal/memory/timeline_window.h"
#include "frugal/train/policy.h"

namespace frugal {

/// Records the trainer's steps `first` to `last` (1-based calls of `step`; `last` 0: only
/// `first`) with a MemoryRecorder of the trainer's device (its probe's: the CPU, or a CUDA
/// device) watching its model and optimizer, and writes `path` when
/// the last of them ends: `.html` a timeline, `.png` its picture, `.pickle`/`.pkl` PyTorch's
/// snapshot, `.json` the events. An allocation refused while recording (out of memory under
/// a cap) writes `<path without extension>.oom.pickle` at once, before OomRecovery or the
/// error's caller sees it.
///
/// Example:
///   trainer.add_policy(std::make_shared<frugal::MemoryTimeline>("step3.html", 3));
class MemoryTimeline : public Policy {
 public:
  explicit MemoryTimeline(std::string path, std::int64_t first = 1, std::int64_t last = 0,
                          MemoryRecorderOptions options = {});
  std::string name() const override { return "memory-timeline"; }
  void on_step_begin(StepContext& ctx) override;
  void on_step_end(StepContext& ctx) override;

  /// The recording, once it began (null before); it keeps what it recorded after the last
  /// step, for its peak.
  const MemoryRecorder* recorder() const { return window_.recorder(); }
  /// The file written, or "" before the last recorded step ended.
  const std::string& written() const { return window_.written(); }
  /// Where a refused allocation's snapshot goes.
  const std::string& oom_path() const { return window_.oom_path(); }

 private:
  MemoryTimelineWindow window_;
};

}  // namespace frugal
