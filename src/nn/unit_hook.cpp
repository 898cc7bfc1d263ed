#include "frugal/nn/unit_hook.h"

#include <mutex>
#include <unordered_map>

#include "frugal/error.h"

namespace frugal::nn {
namespace {

struct UnitHooks {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<UnitHook>> hooks;
};

UnitHooks& unit_hooks() {
  static auto* r = new UnitHooks();  // never destroyed: optimizers may outlive static teardown
  return *r;
}

}  // namespace

std::shared_ptr<UnitHook> unit_hook(const torch::nn::Module& module) {
  auto& r = unit_hooks();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.hooks.empty()) {
    return nullptr;
  }
  const auto found = r.hooks.find(&module);
  return found == r.hooks.end() ? nullptr : found->second;
}

namespace detail {

void add_unit_hook(const torch::nn::Module* module, std::shared_ptr<UnitHook> hook) {
  auto& r = unit_hooks();
  std::lock_guard<std::mutex> lock(r.mutex);
  FRUGAL_CHECK(r.hooks.emplace(module, std::move(hook)).second, "frugal: module '", module->name(),
               "' is a unit of another sharded optimizer already");
}

void remove_unit_hook(const torch::nn::Module* module) {
  auto& r = unit_hooks();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.hooks.erase(module);
}

}  // namespace detail
}  // namespace frugal::nn
