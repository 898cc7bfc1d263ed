#include "step_guard.h"

#include <unordered_map>

#include "../memory/state_tensors.h"
#include "compat.h"
#include "frugal/memory/ledger.h"

namespace frugal::detail {
namespace {

OptimizerStepGuard::Versions versions_of(const torch::optim::OptimizerParamState& state) {
  OptimizerStepGuard::Versions out;
  for_each_state_tensor(state, [&](const torch::Tensor& t) {
    out.push_back(t.defined() ? static_cast<std::int64_t>(t._version()) : -1);
  });
  return out;
}

}  // namespace

OptimizerStepGuard::OptimizerStepGuard(torch::optim::Optimizer& optimizer)
    : optimizer_(optimizer) {
  auto& state = optimizer_.state();
  std::size_t count = 0;
  for (const auto& group : optimizer_.param_groups()) {
    count += group.params().size();
  }
  entries_.reserve(count);
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      Entry entry{p, static_cast<std::int64_t>(p._version()), nullptr, {}};
      const auto it = state.find(compat::optimizer_state_key(p));
      if (it != state.end()) {
        entry.state = it->second->clone();
        entry.state_versions = versions_of(*it->second);
      }
      entries_.push_back(std::move(entry));
    }
  }
}

bool OptimizerStepGuard::changed(const Entry& entry) const {
  if (static_cast<std::int64_t>(entry.param._version()) != entry.version) {
    return true;
  }
  const auto& state = optimizer_.state();
  const auto it = state.find(compat::optimizer_state_key(entry.param));
  if (it == state.end() || entry.state == nullptr) {
    return false;  // new state is undone by restore_unchanged
  }
  return versions_of(*it->second) != entry.state_versions;
}

std::vector<torch::Tensor> OptimizerStepGuard::changed() const {
  std::vector<torch::Tensor> out;
  for (const auto& entry : entries_) {
    if (changed(entry)) {
      out.push_back(entry.param);
    }
  }
  return out;
}

void OptimizerStepGuard::restore_unchanged() {
  auto& state = optimizer_.state();
  for (auto& entry : entries_) {
    if (changed(entry)) {
      continue;
    }
    const auto key = compat::optimizer_state_key(entry.param);
    if (entry.state == nullptr) {
      state.erase(key);
    } else {
      state[key] = std::move(entry.state);
    }
  }
}

std::vector<std::string> parameter_names(const torch::nn::Module& module,
                                         const std::vector<torch::Tensor>& params) {
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : module.named_parameters()) {
    names[item.value().unsafeGetTensorImpl()] = item.key();
  }
  std::vector<std::string> out;
  for (const auto& p : params) {
    const auto it = names.find(p.unsafeGetTensorImpl());
    out.push_back(it != names.end() ? it->second : "(a parameter outside the module)");
  }
  return out;
}

}  // namespace frugal::detail
