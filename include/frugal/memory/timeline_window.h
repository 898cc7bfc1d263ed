// Records a span of repeated calls (a Trainer's steps, a Loop's iterations) with a
// MemoryRecorder and writes its file when the span ends.
#pragma once

#include <c10/util/Optional.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "frugal/memory/recorder.h"

namespace frugal {

/// What to record: calls `first` to `last` (1-based; `last` 0: only `first`), written to
/// `path` when the last of them ends: `.html` a timeline, `.png` its picture, `.pickle`/`.pkl`
/// PyTorch's snapshot, `.json` the events. An allocation refused while recording (out of
/// memory under a cap) writes `<path without extension>.oom.pickle` at once.
struct MemoryTimelineSpan {
  MemoryTimelineSpan(std::string path, std::int64_t first = 1, std::int64_t last = 0,
                     MemoryRecorderOptions options = {})
      : path(std::move(path)), first(first), last(last), options(std::move(options)) {}
  std::string path;
  std::int64_t first;
  std::int64_t last;
  MemoryRecorderOptions options;
};

/// Counts the calls of a span and owns the recorder while it records.
///
/// Example:
///   frugal::MemoryTimelineWindow window({"step3.html", 3});
///   for (std::int64_t call = 1; call <= 5; ++call) {
///     if (auto* recorder = window.begin()) recorder->watch(*model, &optimizer);
///     trainer.step(batch);
///     window.end();
///   }
class MemoryTimelineWindow {
 public:
  /// An error naming the bad value: a first below 1, a last before the first, a path of
  /// another kind; nothing recorded yet.
  explicit MemoryTimelineWindow(MemoryTimelineSpan span);

  /// The next call begins; returns the recorder when this call starts the recording (for
  /// the caller to watch its models), null otherwise. `device`: the memory it records (the
  /// trainer's or loop's device), instead of the span's options'.
  MemoryRecorder* begin(c10::optional<torch::Device> device = c10::nullopt);
  /// The call begun last ends; stops and writes the file after the span's last call.
  /// Returns whether it wrote.
  bool end();

  std::int64_t calls() const { return calls_; }
  const MemoryTimelineSpan& span() const { return span_; }
  /// The recording, once it began (null before); kept after the span for its peak.
  const MemoryRecorder* recorder() const { return recorder_.get(); }
  MemoryRecorder* recorder() { return recorder_.get(); }
  /// The file written, or "" before the span's last call ended.
  const std::string& written() const { return written_; }
  /// Where a refused allocation's snapshot goes.
  const std::string& oom_path() const { return oom_path_; }

 private:
  MemoryTimelineSpan span_;
  std::string oom_path_;
  std::int64_t calls_ = 0;
  std::unique_ptr<MemoryRecorder> recorder_;
  std::string written_;
};

}  // namespace frugal
