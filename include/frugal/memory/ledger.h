// Where the allocated bytes went: weights, gradients, optimizer state, the rest.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

#include "frugal/memory/probe.h"

namespace frugal {

/// A split of a device's allocated bytes, process-wide whatever the probe's scope. Each storage is counted once, in the first of
/// weights, gradients, optimizer state that holds it, however many tensors view it.
/// `other` is the rest: activations, temporaries, anything else alive on the device.
/// On the CPU the parts are exact: with nothing else alive, `other` is 0.
struct Ledger {
  std::int64_t weights = 0;    ///< parameters and buffers
  std::int64_t gradients = 0;  ///< parameters' .grad
  std::int64_t optimizer = 0;  ///< optimizer state (momentum, Adam's moments, ...)
  std::int64_t other = 0;      ///< allocated - the three above
  std::int64_t allocated = 0;  ///< the device's process-wide allocated bytes when measured

  std::string summary() const;
  std::string to_json() const;
};

/// Measures the ledger of `module` and, if given, `optimizer` on the probe's device.
/// Optimizer state is read for SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS and states that
/// are a StateTensorList (frugal's 8-bit optimizers), and what an optimizer that is a
/// LedgerParts names; other optimizers' state lands in `other`.
///
/// Example:
///   auto ledger = frugal::measure_ledger(probe, *model, &optimizer);
Ledger measure_ledger(const MemoryProbe& probe, const torch::nn::Module& module,
                      const torch::optim::Optimizer* optimizer = nullptr);

/// For optimizer param states of other types than LibTorch's: a state that derives from
/// this (as well as from OptimizerParamState) says which tensors it holds, and the ledger
/// and the trainer's step guard see them.
///
/// Example:
///   struct MyState : torch::optim::OptimizerCloneableParamState<MyState>,
///                    frugal::StateTensorList {
///     torch::Tensor buffer;
///     std::vector<torch::Tensor> state_tensors() const override { return {buffer}; }
///   };
class StateTensorList {
 public:
  virtual ~StateTensorList() = default;
  virtual std::vector<torch::Tensor> state_tensors() const = 0;
};

/// An optimizer that keeps weights, gradients or state outside its parameters, their `grad`
/// and its `state()` (a sharded one, frugal::distributed::ZeroOptimizer) derives from this
/// too, so that the ledger counts them as weights, gradients and optimizer state.
class LedgerParts {
 public:
  virtual ~LedgerParts() = default;
  virtual std::vector<torch::Tensor> ledger_weights() const { return {}; }
  virtual std::vector<torch::Tensor> ledger_gradients() const { return {}; }
  virtual std::vector<torch::Tensor> ledger_optimizer_state() const { return {}; }
};

/// The tensors one parameter's optimizer state holds, for the state types of SGD, Adam,
/// AdamW, Adagrad, RMSprop and LBFGS and states that are a StateTensorList (undefined ones
/// included); empty for other types.
std::vector<torch::Tensor> optimizer_state_tensors(
    const torch::optim::OptimizerParamState& state);

}  // namespace frugal
