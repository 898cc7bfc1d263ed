#include "frugal/policy/step_in_backward.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include <typeinfo>

#include "frugal/error.h"

namespace frugal {

void StepInBackward::on_add(PolicyPort& port) {
  FRUGAL_CHECK(optimizer_ == nullptr, "frugal: a StepInBackward policy belongs to one trainer");
  auto* in_place = dynamic_cast<optim::InPlaceOptimizer*>(&port.optimizer());
  FRUGAL_CHECK(in_place != nullptr,
               "frugal: StepInBackward updates one parameter at a time "
               "and needs one of frugal's optimizers (frugal::optim::SGD, Adam or AdamW); the "
               "trainer's optimizer is ",
               c10::demangle(typeid(port.optimizer()).name()));
  optimizer_ = in_place;
}

void StepInBackward::on_grad_ready(StepContext& ctx, const torch::Tensor& param) {
  if (!enabled_) {
    return;
  }
  if (!ctx.trial) {  // a trial measures memory: the gradient goes, the parameter stays
    optimizer_->step_parameter(param);
    ctx.updated_in_backward.push_back(param);
  }
  param.mutable_grad().reset();
}

}  // namespace frugal
