#include "frugal/memory/memory_context.h"

#include <cstddef>

#include "recorder_impl.h"

namespace frugal {
namespace {

thread_local MemoryPhase t_phase = MemoryPhase::Other;
thread_local const torch::nn::Module* t_unit = nullptr;
thread_local int t_materialising = 0;

}  // namespace

const char* to_string(MemoryPhase phase) {
  static constexpr const char* kNames[] = {"other",          "forward",    "backward", "recompute",
                                           "optimizer step", "evaluation", "zeroing"};
  return kNames[static_cast<std::size_t>(phase)];
}

const char* to_string(MemoryCategory category) {
  static constexpr const char* kNames[] = {"weights",     "gradients", "optimizer state",
                                           "activations", "other",     "weights (materialised)"};
  return kNames[static_cast<std::size_t>(category)];
}

PhaseScope::PhaseScope(MemoryPhase phase) : before_(t_phase) {
  detail::tell_phase_boundary();
  t_phase = phase;
}

PhaseScope::~PhaseScope() {
  detail::tell_phase_boundary();
  t_phase = before_;
}

MemoryPhase current_phase() { return t_phase; }

namespace detail {

UnitScope::UnitScope(const torch::nn::Module* module) : before_(t_unit) { t_unit = module; }
UnitScope::~UnitScope() { t_unit = before_; }

const torch::nn::Module* current_unit() { return t_unit; }

}  // namespace detail

namespace detail {

MaterialiseScope::MaterialiseScope() { ++t_materialising; }
MaterialiseScope::~MaterialiseScope() { --t_materialising; }
bool materialising() { return t_materialising > 0; }

}  // namespace detail

}  // namespace frugal
