#include "frugal/memory/ledger.h"

#include <fmt/format.h>
#include <torch/optim.h>

#include <nlohmann/json.hpp>
#include <algorithm>
#include <array>
#include <typeinfo>
#include <unordered_set>
#include <vector>

#include "frugal/memory/format.h"
#include "module_tensors.h"
#include "state_tensors.h"

namespace frugal {
namespace {

// Sums each storage on one device once, across all the categories it is asked about.
class StorageCounter {
 public:
  explicit StorageCounter(torch::Device device) : device_(device) {}

  std::int64_t add(const torch::Tensor& t) {
    if (!t.defined() || !t.has_storage() || t.device() != device_) {
      return 0;
    }
    const auto& storage = t.storage();
    if (!first_sight(storage.unsafeGetStorageImpl())) {
      return 0;
    }
    return static_cast<std::int64_t>(storage.nbytes());
  }

 private:
  // A short list on the stack, searched in place until it fills: most models have a few
  // dozen tensors, where a hash set's allocation per entry costs more than the search.
  static constexpr std::size_t kListed = 64;
  bool first_sight(const void* storage) {
    if (set_.empty() && listed_ < kListed) {
      const auto end = list_.begin() + listed_;
      if (std::find(list_.begin(), end, storage) != end) {
        return false;
      }
      list_[listed_++] = storage;
      return true;
    }
    if (set_.empty()) {
      set_.insert(list_.begin(), list_.end());
    }
    return set_.insert(storage).second;
  }

  torch::Device device_;
  std::array<const void*, kListed> list_;
  std::size_t listed_ = 0;
  std::unordered_set<const void*> set_;
};

Ledger measure_parts(const MemorySnapshot& now, const std::vector<torch::Tensor>& parameters,
                     const std::vector<torch::Tensor>& buffers,
                     const torch::optim::Optimizer* optimizer) {
  StorageCounter counter(now.device);
  Ledger ledger;
  detail::for_each_ledger_tensor(parameters, buffers, optimizer,
                                 [&](const torch::Tensor& t, detail::LedgerPart part) {
                                   const auto bytes = counter.add(t);
                                   switch (part) {
                                     case detail::LedgerPart::Weights:
                                       ledger.weights += bytes;
                                       break;
                                     case detail::LedgerPart::Gradients:
                                       ledger.gradients += bytes;
                                       break;
                                     case detail::LedgerPart::OptimizerState:
                                       ledger.optimizer += bytes;
                                       break;
                                   }
                                 });
  ledger.allocated = now.process_allocated;
  ledger.other = ledger.allocated - ledger.weights - ledger.gradients - ledger.optimizer;
  return ledger;
}

}  // namespace

namespace detail {

void for_each_ledger_tensor(const std::vector<torch::Tensor>& parameters,
                            const std::vector<torch::Tensor>& buffers,
                            const torch::optim::Optimizer* optimizer,
                            c10::function_ref<void(const torch::Tensor&, LedgerPart)> fn) {
  // Weights first, then gradients, then state: a storage counts in the first that holds it.
  for (const auto& p : parameters) {
    fn(p, LedgerPart::Weights);
  }
  for (const auto& b : buffers) {
    fn(b, LedgerPart::Weights);
  }
  const auto* parts = dynamic_cast<const LedgerParts*>(optimizer);
  if (parts != nullptr) {
    for (const auto& t : parts->ledger_weights()) {
      fn(t, LedgerPart::Weights);
    }
  }
  for (const auto& p : parameters) {
    fn(p.grad(), LedgerPart::Gradients);
  }
  if (parts != nullptr) {
    for (const auto& t : parts->ledger_gradients()) {
      fn(t, LedgerPart::Gradients);
    }
  }
  if (optimizer != nullptr) {
    for (const auto& entry : optimizer->state()) {
      for_each_state_tensor(*entry.second,
                            [&](const torch::Tensor& t) { fn(t, LedgerPart::OptimizerState); });
    }
  }
  if (parts != nullptr) {
    for (const auto& t : parts->ledger_optimizer_state()) {
      fn(t, LedgerPart::OptimizerState);
    }
  }
}

ModuleTensors::ModuleTensors(const torch::nn::Module& module) : module_(module) { refresh(); }

void ModuleTensors::refresh() {
  auto hold = [](const std::vector<torch::Tensor>& from, std::vector<Weak>& to) {
    to.clear();
    for (const auto& t : from) {
      if (t.defined()) {  // an undefined tensor holds no bytes, and no weak reference
        to.emplace_back(t.getIntrusivePtr());
      }
    }
  };
  hold(module_.parameters(), parameters_);
  hold(module_.buffers(), buffers_);
}

bool ModuleTensors::lock(const std::vector<Weak>& from, std::vector<torch::Tensor>& to) {
  to.clear();
  to.reserve(from.size());
  for (const auto& weak : from) {
    auto strong = weak.lock();
    if (!strong) {
      return false;
    }
    to.emplace_back(std::move(strong));
  }
  return true;
}

void ModuleTensors::read() {
  if (!lock(parameters_, held_parameters_) || !lock(buffers_, held_buffers_)) {
    refresh();
    lock(parameters_, held_parameters_);
    lock(buffers_, held_buffers_);
  }
}

Ledger measure_ledger(const MemorySnapshot& now, ModuleTensors& tensors,
                      const torch::optim::Optimizer* optimizer) {
  return tensors.with_tensors(
      [&](const std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>& buffers) {
        return measure_parts(now, parameters, buffers, optimizer);
      });
}

namespace {

// Adam's and AdamW's states, which hold the same tensors.
template <typename State>
void visit_adam_state(const State& state, c10::function_ref<void(const torch::Tensor&)> fn) {
  fn(state.exp_avg());
  fn(state.exp_avg_sq());
  fn(state.max_exp_avg_sq());
}

}  // namespace

void for_each_state_tensor(const torch::optim::OptimizerParamState& s,
                           c10::function_ref<void(const torch::Tensor&)> fn) {
  using namespace torch::optim;
  // LibTorch's own states by their exact type first: a typeid comparison, where a failed
  // dynamic_cast walks the class hierarchy (this runs for every parameter every step).
  const auto& type = typeid(s);
  if (type == typeid(AdamParamState)) {
    return visit_adam_state(static_cast<const AdamParamState&>(s), fn);
  }
  if (type == typeid(AdamWParamState)) {
    return visit_adam_state(static_cast<const AdamWParamState&>(s), fn);
  }
  if (type == typeid(SGDParamState)) {
    return fn(static_cast<const SGDParamState&>(s).momentum_buffer());
  }
  // Then by what a state derives from: frugal's list first, LibTorch's states' subclasses.
  if (auto* list = dynamic_cast<const StateTensorList*>(&s)) {
    for (const auto& t : list->state_tensors()) {
      fn(t);
    }
    return;
  }
  if (auto* sgd = dynamic_cast<const SGDParamState*>(&s)) {
    return fn(sgd->momentum_buffer());
  }
  if (auto* adam = dynamic_cast<const AdamParamState*>(&s)) {
    return visit_adam_state(*adam, fn);
  }
  if (auto* adamw = dynamic_cast<const AdamWParamState*>(&s)) {
    return visit_adam_state(*adamw, fn);
  }
  if (auto* adagrad = dynamic_cast<const AdagradParamState*>(&s)) {
    return fn(adagrad->sum());
  }
  if (auto* rms = dynamic_cast<const RMSpropParamState*>(&s)) {
    fn(rms->square_avg());
    fn(rms->momentum_buffer());
    return fn(rms->grad_avg());
  }
  if (auto* lbfgs = dynamic_cast<const LBFGSParamState*>(&s)) {
    fn(lbfgs->d());
    fn(lbfgs->H_diag());
    fn(lbfgs->prev_flat_grad());
    for (const auto& list : {lbfgs->old_dirs(), lbfgs->old_stps(), lbfgs->ro()}) {
      for (const auto& t : list) {
        fn(t);
      }
    }
    if (lbfgs->al().has_value()) {
      for (const auto& t : *lbfgs->al()) {
        fn(t);
      }
    }
  }
}

}  // namespace detail

std::vector<torch::Tensor> optimizer_state_tensors(const torch::optim::OptimizerParamState& s) {
  std::vector<torch::Tensor> out;
  detail::for_each_state_tensor(s, [&](const torch::Tensor& t) { out.push_back(t); });
  return out;
}

Ledger measure_ledger(const MemoryProbe& probe, const torch::nn::Module& module,
                      const torch::optim::Optimizer* optimizer) {
  return measure_parts(probe.snapshot(), module.parameters(), module.buffers(), optimizer);
}

std::string Ledger::summary() const {
  return fmt::format("weights {}, gradients {}, optimizer {}, other {}", format_bytes(weights),
                     format_bytes(gradients), format_bytes(optimizer), format_bytes(other));
}

std::string Ledger::to_json() const {
  nlohmann::json j = {{"weights_bytes", weights},
                      {"grads_bytes", gradients},
                      {"optimizer_bytes", optimizer},
                      {"other_bytes", other},
                      {"allocated_bytes", allocated}};
  return j.dump();
}

}  // namespace frugal
