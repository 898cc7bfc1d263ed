// What one owner attached to a module (a checkpoint choice, a unit's hook), looked up by
// address on every nn::call: a process-wide map guarded by a mutex.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <mutex>
#include <unordered_map>

#include "frugal/error.h"

namespace frugal::nn::detail {

template <typename T>
class ModuleRegistry {
 public:
  /// Attaches `value` to `module`; refused, naming the module and then `taken`, when
  /// something is attached to it already.
  void add(const torch::nn::Module* module, std::shared_ptr<T> value, const char* taken) {
    std::lock_guard<std::mutex> lock(mutex_);
    FRUGAL_CHECK(map_.emplace(module, std::move(value)).second, "frugal: module '", module->name(),
                 "' ", taken);
  }
  void remove(const torch::nn::Module* module) {
    std::lock_guard<std::mutex> lock(mutex_);
    map_.erase(module);
  }
  /// What is attached to `module`, or null.
  std::shared_ptr<T> find(const torch::nn::Module& module) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (map_.empty()) {
      return nullptr;
    }
    const auto found = map_.find(&module);
    return found == map_.end() ? nullptr : found->second;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<T>> map_;
};

}  // namespace frugal::nn::detail
