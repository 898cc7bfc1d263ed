// What a policy needs of the step and what it does to it, declared once.
#pragma once

#include <cstdint>

namespace frugal {

/// One capability the engine must know of, declared by a policy (Policy::traits) or an
/// optimizer (optim::ShardedOptimizer). The trainer reads a policy's traits once, when the
/// policy is added, and refuses pairs that cannot work together (one table: the rules
/// Trainer::add_policy names in its error).
enum class Trait : std::uint32_t {
  /// Needs on_grad_ready calls: the engine hooks every parameter's gradient.
  GradReady = 1u << 0,
  /// Reads every gradient of a step before any parameter changes (clipping by the global
  /// norm, a GradScaler's inf/NaN check).
  AllGradients = 1u << 1,
  /// May ask to run a failed batch again (on_step_error returns true): the engine then
  /// keeps the gradients of a window's earlier batches aside while a batch runs.
  Retries = 1u << 2,
  /// Changes parameters during backward.
  UpdatesInBackward = 1u << 3,
  /// Decides itself what a NaN or infinite loss or gradient does to the step: the engine's
  /// guard (TrainerOptions::skip_non_finite) stays out of its way.
  OwnsNonFinite = 1u << 4,
  /// Sends gradients to other processes during backward.
  SharesGradients = 1u << 5,
  /// Keeps the step's gradients itself, each process its share, so that the parameters
  /// hold none at the optimizer step (an optimizer's trait: ZeRO stage 2).
  KeepsGradients = 1u << 6,
  /// Keeps each process's share of the parameters between steps and gathers them whole for
  /// the forward and backward (an optimizer's trait: ZeRO stage 3).
  ShardsParameters = 1u << 7,
  /// Updates each process's share of the parameters during backward, from gradients the
  /// processes have averaged already (an optimizer's trait: ZeRO stage 3 stepping in
  /// backward): the engine skips a non-finite window's last backward, as for
  /// UpdatesInBackward.
  UpdatesSharesInBackward = 1u << 8,
};

/// The name a trait has in errors and reports ("all-gradients", ...).
const char* trait_name(Trait trait);

/// A set of traits: `Trait::GradReady | Trait::UpdatesInBackward`.
class Traits {
 public:
  constexpr Traits() = default;
  constexpr Traits(Trait trait)  // NOLINT(google-explicit-constructor): a set of one
      : bits_(static_cast<std::uint32_t>(trait)) {}

  constexpr bool has(Trait trait) const { return (bits_ & static_cast<std::uint32_t>(trait)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  constexpr Traits operator|(Traits other) const { return Traits(bits_ | other.bits_, 0); }
  constexpr Traits& operator|=(Traits other) { return *this = *this | other; }
  constexpr bool operator==(Traits other) const { return bits_ == other.bits_; }
  constexpr bool operator!=(Traits other) const { return bits_ != other.bits_; }

 private:
  constexpr Traits(std::uint32_t bits, int /*raw*/) : bits_(bits) {}
  std::uint32_t bits_ = 0;
};

constexpr Traits operator|(Trait a, Trait b) { return Traits(a) | Traits(b); }

}  // namespace frugal
