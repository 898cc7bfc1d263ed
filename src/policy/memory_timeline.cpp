#include "frugal/policy/memory_timeline.h"

#include <utility>

namespace frugal {

MemoryTimeline::MemoryTimeline(std::string path, std::int64_t first, std::int64_t last,
                               MemoryRecorderOptions options)
    : window_(MemoryTimelineSpan(std::move(path), first, last, std::move(options))) {}

void MemoryTimeline::on_step_begin(StepContext& ctx) {
  if (ctx.trial) {
    return;
  }
  if (auto* recorder = window_.begin(ctx.probe.device())) {
    recorder->watch(ctx.module, &ctx.optimizer);
  }
}

void MemoryTimeline::on_step_end(StepContext& ctx) {
  if (!ctx.trial) {
    window_.end();
  }
}

}  // namespace frugal
