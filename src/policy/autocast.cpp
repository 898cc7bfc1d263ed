#include "frugal/policy/autocast.h"

#include <c10/util/Exception.h>

namespace frugal {

AutocastPolicy::AutocastPolicy(torch::DeviceType device_type, torch::Dtype dtype)
    : type_(device_type), dtype_(dtype) {
  AutocastGuard::check_supported(device_type, dtype);
}

std::string AutocastPolicy::name() const {
  return std::string("autocast-") + c10::toString(dtype_);
}

void AutocastPolicy::enter() {
  active_.push_back(std::make_unique<AutocastGuard>(type_, dtype_, enabled_));
}

void AutocastPolicy::leave() {
  if (!active_.empty()) {
    active_.pop_back();
  }
}

void AutocastPolicy::before_forward(StepContext&) { enter(); }
void AutocastPolicy::after_forward(StepContext&) { leave(); }
void AutocastPolicy::on_evaluate_begin(PolicyPort&) { enter(); }
void AutocastPolicy::on_evaluate_end(PolicyPort&) { leave(); }

}  // namespace frugal
