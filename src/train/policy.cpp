#include "frugal/train/policy.h"

namespace frugal {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::StepBegin:
      return "step-begin";
    case Phase::BeforeForward:
      return "before-forward";
    case Phase::AfterForward:
      return "after-forward";
    case Phase::BeforeBackward:
      return "before-backward";
    case Phase::AfterBackward:
      return "after-backward";
    case Phase::BeforeOptimizerStep:
      return "before-optimizer-step";
    case Phase::AfterOptimizerStep:
      return "after-optimizer-step";
    case Phase::AfterZeroGrad:
      return "after-zero-grad";
    case Phase::StepEnd:
      return "step-end";
  }
  return "unknown";
}

HookPolicy::HookPolicy(Phase phase, Fn fn, std::string name)
    : phase_(phase), fn_(std::move(fn)), name_(std::move(name)) {}

}  // namespace frugal
