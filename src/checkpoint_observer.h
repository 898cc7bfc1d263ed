// What a checkpointed block does when, seen from outside: how budgeted checkpointing
// measures each block of a step.
#pragma once

#include <torch/types.h>

#include <string>
#include <vector>

namespace frugal {

/// The phases of one checkpointed block, in the order a step runs them: its forward (no
/// activations kept), then in backward the recompute (activations kept) and the backward
/// through the recomputed graph.
enum class CheckpointPhase {
  ForwardBegin,
  ForwardEnd,  ///< the block's outputs are given
  RecomputeBegin,
  RecomputeEnd,  ///< the recompute's outputs are given
  BackwardEnd,
};

class CheckpointObserver {
 public:
  virtual ~CheckpointObserver() = default;
  /// `block` is CheckpointOptions::name; `outputs` are given at ForwardEnd and RecomputeEnd.
  virtual void on(CheckpointPhase phase, const std::string& block,
                  const std::vector<torch::Tensor>& outputs) = 0;
};

/// Installs `observer` for every checkpoint of the process (nullptr: none) and returns the
/// one it replaces. The observer must outlive its installation.
CheckpointObserver* set_checkpoint_observer(CheckpointObserver* observer);

}  // namespace frugal
