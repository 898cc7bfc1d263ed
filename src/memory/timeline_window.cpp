#include "frugal/memory/timeline_window.h"

#include <utility>

#include "frugal/error.h"

namespace frugal {

MemoryTimelineWindow::MemoryTimelineWindow(MemoryTimelineSpan span) : span_(std::move(span)) {
  if (span_.last == 0) {
    span_.last = span_.first;
  }
  FRUGAL_CHECK(span_.first >= 1 && span_.last >= span_.first, "frugal: a memory timeline records ",
               span_.first, " to ", span_.last,
               ": the first must be >= 1 and the last >= the first");
  MemoryRecorder::check_path(span_.path);  // refused now, not after the calls it would record
  oom_path_ = span_.path.substr(0, span_.path.rfind('.')) + ".oom.pickle";
  span_.options.oom_file(oom_path_);
}

MemoryRecorder* MemoryTimelineWindow::begin(c10::optional<torch::Device> device) {
  ++calls_;
  if (calls_ != span_.first) {
    return nullptr;
  }
  auto options = span_.options;
  if (device) {
    options.device(*device);
  }
  recorder_ = std::make_unique<MemoryRecorder>(options);
  return recorder_.get();
}

bool MemoryTimelineWindow::end() {
  if (recorder_ == nullptr || !recorder_->recording() || calls_ < span_.last) {
    return false;
  }
  recorder_->stop();
  recorder_->write(span_.path);
  written_ = span_.path;
  return true;
}

}  // namespace frugal
