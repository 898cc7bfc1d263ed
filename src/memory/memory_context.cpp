#include "frugal/memory/memory_context.h"

#include <c10/util/ThreadLocalDebugInfo.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string_view>
#include <type_traits>

#include "recorder_impl.h"

namespace frugal {
namespace {

// The phase travels in LibTorch's thread-local debug information, which at::ThreadLocalState
// carries to the threads that work for this one: autograd's device threads (a CUDA backward
// runs there, not on the thread that called it) and at::launch's. A kind of frugal's own, so
// no one else's information is replaced: named by a string's address where LibTorch allows
// kinds of one's own (2.x), a value outside those it names where the kind is an enum (1.13).
constexpr std::string_view kPhaseInfoName = "frugal's memory phase";

template <typename Kind>
Kind phase_info_kind() {
  if constexpr (std::is_enum_v<Kind>) {
    return static_cast<Kind>(0xf5);
  } else {
    return Kind(&kPhaseInfoName);
  }
}

const auto kPhaseInfo = phase_info_kind<c10::DebugInfoKind>();

struct PhaseInfo : c10::DebugInfoBase {
  explicit PhaseInfo(MemoryPhase p) : phase(p) {}
  MemoryPhase phase;
};

// One shared record a phase, made once: entering a scope allocates only LibTorch's node.
const std::shared_ptr<c10::DebugInfoBase>& info_of(MemoryPhase phase) {
  static const auto infos = [] {
    std::array<std::shared_ptr<c10::DebugInfoBase>, 7> out;
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = std::make_shared<PhaseInfo>(static_cast<MemoryPhase>(i));
    }
    return out;
  }();
  return infos.at(static_cast<std::size_t>(phase));
}

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

PhaseScope::PhaseScope(MemoryPhase phase) {
  detail::tell_phase_boundary();
  c10::ThreadLocalDebugInfo::_push(kPhaseInfo, info_of(phase));
}

PhaseScope::~PhaseScope() {
  detail::tell_phase_boundary();
  // Its own record is on top where scopes end in the reverse order of their making; where
  // they do not (or another kind was pushed over it and kept), the thread's information is
  // left as it is rather than an error thrown from a destructor.
  try {
    c10::ThreadLocalDebugInfo::_pop(kPhaseInfo);
  } catch (const c10::Error&) {
  }
}

MemoryPhase current_phase() {
  const auto* info = static_cast<const PhaseInfo*>(c10::ThreadLocalDebugInfo::get(kPhaseInfo));
  return info != nullptr ? info->phase : MemoryPhase::Other;
}

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
