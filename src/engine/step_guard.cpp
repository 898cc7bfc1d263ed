#include "step_guard.h"

#include <unordered_map>

#include "../memory/state_tensors.h"
#include "compat.h"
#include "frugal/memory/ledger.h"

namespace frugal::detail {
namespace {

using torch::optim::AdamParamState;
using torch::optim::AdamWParamState;
using torch::optim::OptimizerParamState;
using torch::optim::SGDParamState;

// LibTorch's states whose only field besides tensors is a step counter (SGD's has none):
// true, with the counter in `step`; false for any other type, which the guard copies.
bool read_counter(const OptimizerParamState& state, std::int64_t& step) {
  const auto& type = typeid(state);
  if (type == typeid(AdamParamState)) {
    step = static_cast<const AdamParamState&>(state).step();
  } else if (type == typeid(AdamWParamState)) {
    step = static_cast<const AdamWParamState&>(state).step();
  } else {
    step = 0;
    return type == typeid(SGDParamState);
  }
  return true;
}

void set_counter(OptimizerParamState& state, std::int64_t step) {
  const auto& type = typeid(state);
  if (type == typeid(AdamParamState)) {
    static_cast<AdamParamState&>(state).step(step);
  } else if (type == typeid(AdamWParamState)) {
    static_cast<AdamWParamState&>(state).step(step);
  }
}

}  // namespace

OptimizerStepGuard::OptimizerStepGuard(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {
  auto& state = optimizer_.state();
  std::size_t count = 0;
  for (const auto& group : optimizer_.param_groups()) {
    count += group.params().size();
  }
  entries_.reserve(count);
  for (auto& group : optimizer_.param_groups()) {
    for (auto& p : group.params()) {
      entries_.emplace_back();
      auto& entry = entries_.back();
      entry.param = p;
      entry.version = static_cast<std::int64_t>(p._version());
      const auto it = state.find(compat::optimizer_state_key(p));
      if (it == state.end()) {
        continue;
      }
      const auto& live = *it->second;
      entry.type = &typeid(live);
      if (!read_counter(live, entry.step)) {
        entry.copy = live.clone();
      }
      for_each_state_tensor(live, [&](const torch::Tensor& t) {
        entry.tensors.push_back({t, t.defined() ? static_cast<std::int64_t>(t._version()) : -1});
      });
    }
  }
}

bool OptimizerStepGuard::changed(const Entry& entry) const {
  if (static_cast<std::int64_t>(entry.param._version()) != entry.version) {
    return true;
  }
  const auto& state = optimizer_.state();
  const auto it = state.find(compat::optimizer_state_key(entry.param));
  if (entry.type == nullptr) {
    return false;  // new state is undone by restore_unchanged
  }
  if (it == state.end()) {
    return entry.copy == nullptr;  // a copy can be put back; a counter cannot
  }
  if (typeid(*it->second) != *entry.type) {
    return true;  // the step replaced the state object
  }
  std::size_t i = 0;
  bool moved = false;
  for_each_state_tensor(*it->second, [&](const torch::Tensor& t) {
    if (moved || i >= entry.tensors.size()) {
      moved = true;
      return;
    }
    const auto& held = entry.tensors[i++];
    const std::int64_t version = t.defined() ? static_cast<std::int64_t>(t._version()) : -1;
    moved = !t.is_same(held.tensor) || version != held.version;
  });
  return moved || i != entry.tensors.size();
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
    if (entry.type == nullptr) {
      state.erase(key);
    } else if (entry.copy != nullptr) {
      state[key] = std::move(entry.copy);
    } else {
      const auto it = state.find(key);
      if (it != state.end()) {
        set_counter(*it->second, entry.step);
      }
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
