// ZeRO-3 units: each chosen module's parameters are gathered just before its forward
// (reached through frugal::nn::call) and released after it, gathered again just before its
// backward and released once its gradients are in.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <vector>

#include "compat.h"
#include "zero_layout.h"

namespace frugal::distributed::detail {

/// The positions (in `params`) of each module's parameters; an error when a module holds
/// none of them or shares one with another module.
std::vector<std::vector<std::size_t>> unit_members(
    const std::vector<torch::Tensor>& params,
    const std::vector<std::shared_ptr<torch::nn::Module>>& modules);

/// The hooks of the units of `layout` (units[1..] are `modules`, in order), installed for
/// as long as this object lives.
class ZeroUnitHooks {
 public:
  ZeroUnitHooks(const std::shared_ptr<ZeroLayout>& layout,
                const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
  ~ZeroUnitHooks();
  ZeroUnitHooks(const ZeroUnitHooks&) = delete;
  ZeroUnitHooks& operator=(const ZeroUnitHooks&) = delete;

 private:
  std::vector<const torch::nn::Module*> modules_;
  std::vector<std::unique_ptr<compat::GradAccumulatedHook>> accumulated_;
};

}  // namespace frugal::distributed::detail
