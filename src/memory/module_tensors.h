// The tensors of a module that the ledger counts as its weights, read once and held weakly.
#pragma once

#include <c10/core/TensorImpl.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/ScopeExit.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <vector>

#include "frugal/memory/ledger.h"

namespace frugal::detail {

/// A module's parameters and buffers, as of the last read of the module tree. Walking the
/// tree (parameters(), buffers()) builds a dictionary of names at every level and costs
/// more than the rest of the ledger together, so a trainer that measures the ledger every
/// step reads the tree once. The tensors are held weakly: a buffer the module replaced is
/// not kept alive by this list, and its being freed makes the next read walk the tree again.
///
/// Example:
///   frugal::detail::ModuleTensors tensors(*model);
///   auto ledger = frugal::detail::measure_ledger(probe.snapshot(), tensors, &optimizer);
class ModuleTensors {
 public:
  explicit ModuleTensors(const torch::nn::Module& module);

  /// Walks the module tree again (after the module registered new parameters or buffers).
  void refresh();
  /// Calls `fn(parameters, buffers)` with the parameters and buffers alive now, walking the
  /// tree again first where one read before has been freed. They are held only for the
  /// call, in lists that keep their room from one call to the next (a step allocates none).
  template <typename Fn>
  auto with_tensors(Fn fn) {
    read();
    const auto release = c10::make_scope_exit([this] {
      held_parameters_.clear();
      held_buffers_.clear();
    });
    return fn(held_parameters_, held_buffers_);
  }

 private:
  void read();  // locks the weak lists into the held ones
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  static bool lock(const std::vector<Weak>& from, std::vector<torch::Tensor>& to);

  const torch::nn::Module& module_;
  std::vector<Weak> parameters_;
  std::vector<Weak> buffers_;
  std::vector<torch::Tensor> held_parameters_, held_buffers_;  // with_tensors' lists
};

/// The ledger's parts.
enum class LedgerPart { Weights, Gradients, OptimizerState };

/// Calls `fn` on every tensor the ledger reads, with the part it counts in, in the ledger's
/// order: a storage belongs to the first part that holds it (undefined tensors included).
void for_each_ledger_tensor(const std::vector<torch::Tensor>& parameters,
                            const std::vector<torch::Tensor>& buffers,
                            const torch::optim::Optimizer* optimizer,
                            c10::function_ref<void(const torch::Tensor&, LedgerPart)> fn);

/// measure_ledger over the tensors of `module` as `tensors` holds them, on the device of
/// `now` and against its process-wide allocated bytes (a snapshot the caller took already).
Ledger measure_ledger(const MemorySnapshot& now, ModuleTensors& tensors,
                      const torch::optim::Optimizer* optimizer);

}  // namespace frugal::detail
