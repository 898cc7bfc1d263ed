#include "frugal/nn/unit_hook.h"

#include "frugal/error.h"
#include "module_registry.h"

namespace frugal::nn {
namespace {

detail::ModuleRegistry<UnitHook>& unit_hooks() {
  // Never destroyed: optimizers may outlive static teardown.
  static auto* r = new detail::ModuleRegistry<UnitHook>();
  return *r;
}

}  // namespace

std::shared_ptr<UnitHook> unit_hook(const torch::nn::Module& module) {
  return unit_hooks().find(module);
}

namespace detail {

void add_unit_hook(const torch::nn::Module* module, std::shared_ptr<UnitHook> hook) {
  unit_hooks().add(module, std::move(hook), "is a unit of another sharded optimizer already");
}

void remove_unit_hook(const torch::nn::Module* module) { unit_hooks().remove(module); }

}  // namespace detail
}  // namespace frugal::nn
