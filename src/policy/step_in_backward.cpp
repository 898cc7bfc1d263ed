#include "frugal/policy/step_in_backward.h"

#include "../engine/in_backward.h"
#include "frugal/error.h"

namespace frugal {

void StepInBackward::on_add(PolicyPort& port) {
  FRUGAL_CHECK(optimizer_ == nullptr, "frugal: a StepInBackward policy belongs to one trainer");
  optimizer_ = &detail::in_place_optimizer(port.optimizer(), "StepInBackward");
}

void StepInBackward::on_grad_ready(StepContext& ctx, const torch::Tensor& param) {
  if (!enabled_) {
    return;
  }
  if (ctx.trial) {  // a trial measures memory: the gradient goes, the parameter stays
    param.mutable_grad().reset();
    return;
  }
  detail::step_in_backward(*optimizer_, param, ctx.updated_in_backward);
}

}  // namespace frugal
