#include "frugal/policy/leak_guard.h"

namespace frugal {

void LeakGuard::on_step_end(StepContext& ctx) {
  if (ctx.report.stepped) {  // inside an accumulation window gradients are meant to be held
    check_.observe(ctx.report.memory.allocated, ctx.report.step);
  }
}

}  // namespace frugal
