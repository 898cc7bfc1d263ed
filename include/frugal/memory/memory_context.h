// What the calling thread is doing, for a MemoryRecorder: the phase of the step and the
// unit (module) it runs. Marking costs little when nothing records (a phase: one small
// allocation; a unit: a thread-local write).
#pragma once

#include <cstdint>

namespace torch::nn {
class Module;
}

namespace frugal {

/// What the thread was doing when a block was allocated.
enum class MemoryPhase : std::uint8_t {
  Other,
  Forward,
  Backward,
  Recompute,  ///< a checkpointed block's forward run again in backward
  OptimizerStep,
  Evaluation,
  Zeroing,
};
const char* to_string(MemoryPhase phase);

/// Marks what the calling thread does until the scope ends (the Trainer, the Loop and the
/// checkpoint mark theirs); nests, restoring the phase before it. The threads that work for
/// this one as autograd's do (given its at::ThreadLocalState: autograd's device threads,
/// at::launch) are in the phase too. Scopes end in the reverse order of their making.
class PhaseScope {
 public:
  explicit PhaseScope(MemoryPhase phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;
};

/// The phase the calling thread is in.
MemoryPhase current_phase();

namespace detail {

/// Marks the module the calling thread runs (frugal::nn::call marks each unit's forward and
/// recompute); nests.
class UnitScope {
 public:
  explicit UnitScope(const torch::nn::Module* module);
  ~UnitScope();
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

 private:
  const torch::nn::Module* before_;
};

/// Marks what the calling thread allocates meanwhile as a unit's weights being made whole
/// (MemoryCategory::MaterialisedWeights); nests.
class MaterialiseScope {
 public:
  MaterialiseScope();
  ~MaterialiseScope();
  MaterialiseScope(const MaterialiseScope&) = delete;
  MaterialiseScope& operator=(const MaterialiseScope&) = delete;
};

/// Whether the calling thread is in a MaterialiseScope.
bool materialising();

}  // namespace detail

}  // namespace frugal
