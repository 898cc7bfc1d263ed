#include "frugal/memory/ledger.h"

#include <fmt/format.h>
#include <torch/optim.h>

#include <nlohmann/json.hpp>
#include <unordered_set>
#include <vector>

#include "frugal/memory/format.h"

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
    if (!seen_.insert(storage.unsafeGetStorageImpl()).second) {
      return 0;
    }
    return static_cast<std::int64_t>(storage.nbytes());
  }

 private:
  torch::Device device_;
  std::unordered_set<const void*> seen_;
};

}  // namespace

std::vector<torch::Tensor> optimizer_state_tensors(const torch::optim::OptimizerParamState& s) {
  using namespace torch::optim;
  if (auto* list = dynamic_cast<const StateTensorList*>(&s)) {
    return list->state_tensors();
  }
  if (auto* sgd = dynamic_cast<const SGDParamState*>(&s)) {
    return {sgd->momentum_buffer()};
  }
  if (auto* adam = dynamic_cast<const AdamParamState*>(&s)) {
    return {adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()};
  }
  if (auto* adamw = dynamic_cast<const AdamWParamState*>(&s)) {
    return {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()};
  }
  if (auto* adagrad = dynamic_cast<const AdagradParamState*>(&s)) {
    return {adagrad->sum()};
  }
  if (auto* rms = dynamic_cast<const RMSpropParamState*>(&s)) {
    return {rms->square_avg(), rms->momentum_buffer(), rms->grad_avg()};
  }
  if (auto* lbfgs = dynamic_cast<const LBFGSParamState*>(&s)) {
    std::vector<torch::Tensor> out = {lbfgs->d(), lbfgs->H_diag(), lbfgs->prev_flat_grad()};
    for (const auto& list : {lbfgs->old_dirs(), lbfgs->old_stps(), lbfgs->ro()}) {
      out.insert(out.end(), list.begin(), list.end());
    }
    if (lbfgs->al().has_value()) {
      out.insert(out.end(), lbfgs->al()->begin(), lbfgs->al()->end());
    }
    return out;
  }
  return {};
}

Ledger measure_ledger(const MemoryProbe& probe, const torch::nn::Module& module,
                      const torch::optim::Optimizer* optimizer) {
  StorageCounter counter(probe.device());
  Ledger ledger;
  for (const auto& p : module.parameters()) {
    ledger.weights += counter.add(p);
  }
  for (const auto& b : module.buffers()) {
    ledger.weights += counter.add(b);
  }
  for (const auto& p : module.parameters()) {
    ledger.gradients += counter.add(p.grad());
  }
  if (optimizer != nullptr) {
    for (const auto& entry : optimizer->state()) {
      for (const auto& t : optimizer_state_tensors(*entry.second)) {
        ledger.optimizer += counter.add(t);
      }
    }
    if (const auto* parts = dynamic_cast<const LedgerParts*>(optimizer)) {
      for (const auto& t : parts->ledger_gradients()) {
        ledger.gradients += counter.add(t);
      }
      for (const auto& t : parts->ledger_optimizer_state()) {
        ledger.optimizer += counter.add(t);
      }
    }
  }
  ledger.allocated = probe.snapshot().process_allocated;
  ledger.other = ledger.allocated - ledger.weights - ledger.gradients - ledger.optimizer;
  return ledger;
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
