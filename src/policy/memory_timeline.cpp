#include "frugal/policy/memory_timeline.h"

#include <utility>

#include "frugal/error.h"

namespace frugal {

MemoryTimeline::MemoryTimeline(std::string path, std::int64_t first, std::int64_t last,
                               MemoryRecorderOptions options)
    : path_(std::move(path)), first_(first), last_(last == 0 ? first : last) {
  FRUGAL_CHECK(first_ >= 1 && last_ >= first_, "frugal: MemoryTimeline records steps ", first_,
               " to ", last_, ": the first must be >= 1 and the last >= the first");
  MemoryRecorder::check_path(path_);  // refused now, not after the steps it would record
  oom_path_ = path_.substr(0, path_.rfind('.')) + ".oom.pickle";
  options_ = options.oom_file(oom_path_);
}

void MemoryTimeline::on_step_begin(StepContext& ctx) {
  if (ctx.trial) {
    return;
  }
  ++calls_;
  if (calls_ == first_) {
    recorder_ = std::make_unique<MemoryRecorder>(options_);
    recorder_->watch(ctx.module, &ctx.optimizer);
  }
}

void MemoryTimeline::on_step_end(StepContext& ctx) {
  if (ctx.trial || recorder_ == nullptr || !recorder_->recording() || calls_ < last_) {
    return;
  }
  recorder_->stop();
  recorder_->write(path_);
  written_ = path_;
}

}  // namespace frugal
